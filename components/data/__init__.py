"""Data components: the byte tokenizer, text corpora and the packed-document dataset.

A dataset folder holds every document once as ``[BOS] + tokens + [EOS]`` in one token array,
plus per-data-epoch document orders; the loader packs an epoch's documents into consecutive
windows, so resuming is a seek on a few integers rather than a replay.
"""

"""Document boundaries inside packed rows: the ``doc_ids`` every built-in loader adds to a batch.

A packed row is a window of a stream of documents; ``doc_ids`` (int32, the shape of
``input_ids``) numbers the documents of each row from its first token: 0 for the document the
row starts in, 1 for the next, and so on. Attention with ``document_mask`` lets a token see only
earlier tokens of its own document (``kiln.components.attention.context``); per-document
positions restart at each change of id. Only equality of neighbouring ids matters, so the
numbering survives cutting a row (micro-batches, context warmup, context-parallel chunks).

Loaders that know where their documents start (``packed_documents``: the document index of
every stream position; ``streaming_text``: the pieces a window is cut from) number them from
that; the others (``balanced_shards`` rows, whose shards hold bare token ids) from the BOS token
that kiln's writers put at every document start (``document_tokens``).
"""

from __future__ import annotations

import numpy as np


def relative(doc_index: np.ndarray) -> np.ndarray:
    """Per-position document indices of a stream (rows, L), non-decreasing along a row ->
    ``doc_ids`` counting from 0 at each row's start (int32)."""
    return (doc_index - doc_index[:, :1]).astype(np.int32)


def from_lengths(lengths: list[int], length: int) -> np.ndarray:
    """The ``doc_ids`` (length,) of a row cut from consecutive pieces of ``lengths`` tokens, one
    document each (the first may be the tail of a document begun in an earlier row)."""
    ids = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    return ids[:length]


def from_bos(tokens: np.ndarray, bos_id: int) -> np.ndarray:
    """``doc_ids`` (rows, L) of token rows (rows, L) whose documents each start with ``bos_id``:
    a new document at every BOS after the first position."""
    starts = tokens == bos_id
    starts[:, 0] = False  # the row's first document is 0 whether or not it starts there
    return np.cumsum(starts, axis=1, dtype=np.int32)

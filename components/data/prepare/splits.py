"""How a packed layout frames its documents, and which of them it holds out for evaluation.

Framing (``separator``): ``bos_eos`` puts ``[BOS] ... [EOS]`` around every document (kiln's
default: per-document positions and ``balanced_shards`` find documents by their BOS); ``eos``
ends each with ``[EOS]`` only (GPT-2's ``<|endoftext|>`` between documents, as nanoGPT's
OpenWebText); ``none`` concatenates them into one continuous stream (nanoGPT's Shakespeare).
The loader knows every document's place either way (the layout's offsets), so document masks
work with all three.

Eval split (``eval_split``): ``random`` holds out a seeded random ``eval_fraction`` of the
documents; ``tail`` the contiguous last ``eval_fraction`` of the tokens, as nanoGPT and most
papers split one text (the document the cut falls in is cut in two there); ``files`` the
documents of named files (``kiln data prepare --eval-input``), which the builder places last.
``tail`` and ``files`` keep the eval documents in their order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.components.errors import DataError

SEPARATORS = {"bos_eos": (True, True), "eos": (False, True), "none": (False, False)}
EVAL_SPLITS = ("random", "tail", "files")
# The seed of the held-out draw of a dataset kiln builds by itself (the cached `packed_documents`
# source, chat, preference and prompt rows, their built-in sets): fixed, not training.seed, so
# every seed of a recipe is scored on the same held-out examples (seed replicates compare, as in
# `kiln sweep --seeds`); training.seed still orders the training data.
SPLIT_SEED = 0


def framing(separator: str) -> tuple[bool, bool]:
    """(BOS before, EOS after) each document."""
    try:
        return SEPARATORS[separator]
    except KeyError:
        raise DataError(f"separator {separator!r}: choose one of {', '.join(SEPARATORS)}") \
            from None


def frame(ids: np.ndarray, lengths: np.ndarray, bos: int, eos: int,
          separator: str = "bos_eos") -> np.ndarray:
    """Documents back to back from their bare ids concatenated, each framed by ``separator``."""
    before, after = framing(separator)
    n, extra = len(lengths), int(before) + int(after)
    out = np.empty(len(ids) + extra * n, dtype=ids.dtype)
    starts = np.concatenate([[0], np.cumsum(lengths + extra)[:-1]]).astype(np.int64)
    special = np.zeros(len(out), dtype=bool)
    if before:
        out[starts] = bos
        special[starts] = True
    if after:
        ends = starts + lengths + int(before)
        out[ends] = eos
        special[ends] = True
    out[~special] = ids
    return out


def framed_lengths(lengths: np.ndarray, separator: str) -> np.ndarray:
    """Each document's length in the stream, its BOS / EOS included."""
    return lengths + sum(framing(separator))


@dataclass
class Split:
    lengths: np.ndarray  # per document in the stream (a cut document counts as two)
    nbytes: np.ndarray  # UTF-8 bytes per document (a cut one's apportioned by its tokens)
    train: np.ndarray  # document ids, sorted
    eval: np.ndarray  # document ids: shuffled (random) or in order (tail, files)
    cut: int  # the eval document that begins inside a cut one (tail), else -1


def split(lengths: np.ndarray, nbytes: np.ndarray, *, eval_split: str, eval_fraction: float,
          seed: int, eval_docs: int = 0) -> Split:
    """The train / eval split of a layout's documents (``eval_docs``: of a ``files`` split)."""
    n = len(lengths)
    if eval_split == "random":
        # the seeded stream packed_layout has always used (seed, purpose 0, epoch 0)
        perm = np.random.default_rng([seed % (1 << 64), 0, 0]).permutation(n)
        n_eval = min(max(round(n * eval_fraction), int(eval_fraction > 0)), n - 1)
        return Split(lengths, nbytes, np.sort(perm[n_eval:]), perm[:n_eval], -1)
    if eval_split == "files":
        if not 0 < eval_docs < n:
            raise DataError(f"the eval files gave {eval_docs} of {n} documents; the eval split "
                            "needs at least one and the train split too")
        return Split(lengths, nbytes, np.arange(n - eval_docs), np.arange(n - eval_docs, n), -1)
    if eval_split != "tail":
        raise DataError(f"eval split {eval_split!r}: choose one of {', '.join(EVAL_SPLITS)}")
    return _tail(lengths, nbytes, eval_fraction)


def _tail(lengths: np.ndarray, nbytes: np.ndarray, fraction: float) -> Split:
    total = int(lengths.sum())
    cut_at = total - round(total * fraction)
    if not 0 < fraction < 1 or not 0 < cut_at < total:
        raise DataError(f"eval split 'tail' with eval fraction {fraction}: give 0 < fraction "
                        f"< 1 of the {total} tokens")
    ends = np.cumsum(lengths)
    doc = int(np.searchsorted(ends, cut_at, side="right"))  # the document holding token cut_at
    start = int(ends[doc] - lengths[doc])
    cut = -1
    if cut_at > start:  # inside a document: cut it in two
        head = cut_at - start
        share = round(int(nbytes[doc]) * head / int(lengths[doc]))
        lengths = np.concatenate([lengths[:doc], [head, lengths[doc] - head], lengths[doc + 1:]])
        nbytes = np.concatenate([nbytes[:doc], [share, nbytes[doc] - share], nbytes[doc + 1:]])
        doc, cut = doc + 1, doc + 1
    ids = np.arange(len(lengths))
    return Split(lengths.astype(np.int64), nbytes.astype(np.int64), ids[:doc], ids[doc:], cut)

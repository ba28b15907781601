"""Conversations into fixed rows of ``seq_len + 1`` tokens, with their loss masks.

``pack = true`` fills each row with whole conversations in order (next fit) and starts a new
row when the next one does not fit; ``pack = false`` puts one conversation in each row. The
rest of a row is padding: its own document, never trained on. A row's ``docs`` number its
conversations, so attention with ``document_mask`` and per-document positions keep them apart,
and a label is kept only where it continues the same conversation.

A conversation longer than a row follows ``overlong``: ``"truncate"`` keeps its first
``seq_len + 1`` tokens (dropped if no trained token is left), ``"drop"`` leaves it out,
``"error"`` stops naming the row. The counts go into the dataset's metadata and the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from kiln.components.errors import DataError
from kiln.components.models.lm_head import IGNORE_INDEX

Overlong = Literal["truncate", "drop", "error"]


@dataclass
class PackStats:
    conversations: int = 0
    truncated: int = 0
    dropped: int = 0
    rows: int = 0
    tokens: int = 0  # conversation tokens placed in rows (padding not counted)
    trained: int = 0  # of those, targets of the loss
    per_row: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, int]:
        return {k: v for k, v in self.__dict__.items() if k != "per_row"}


def fit(ids: np.ndarray, mask: np.ndarray, width: int, policy: Overlong,
        where: str, stats: PackStats) -> tuple[np.ndarray, np.ndarray] | None:
    """The conversation as it goes into rows of ``width`` tokens, or None when dropped."""
    stats.conversations += 1
    if len(ids) <= width:
        return ids, mask
    if policy == "error":
        raise DataError(f"{where}: {len(ids)} tokens, longer than training.seq_len + 1 = "
                        f"{width}; raise seq_len, or set data.overlong = \"truncate\" or "
                        "\"drop\"")
    if policy == "truncate" and mask[1:width].any():
        stats.truncated += 1
        return ids[:width], mask[:width]
    stats.dropped += 1
    return None


def pack(conversations: list[tuple[np.ndarray, np.ndarray]], width: int, *, packed: bool,
         pad_id: int, stats: PackStats) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32 (rows, width), trained flags bool (rows, width), docs int32 (rows,
    width)) of conversations that each fit ``width``."""
    rows: list[list[tuple[np.ndarray, np.ndarray]]] = []
    used = width
    for conv in conversations:
        if not packed or used + len(conv[0]) > width:
            rows.append([])
            used = 0
        rows[-1].append(conv)
        used += len(conv[0])
    tokens = np.full((len(rows), width), pad_id, dtype=np.int32)
    trained = np.zeros((len(rows), width), dtype=bool)
    docs = np.zeros((len(rows), width), dtype=np.int32)
    for r, row in enumerate(rows):
        at = 0
        for d, (ids, mask) in enumerate(row):
            n = len(ids)
            tokens[r, at:at + n], trained[r, at:at + n], docs[r, at:at + n] = ids, mask, d
            at += n
            stats.tokens += n
        docs[r, at:] = len(row)  # padding: a document of its own
    stats.rows += len(rows)
    stats.trained += int(labels_of(tokens, trained, docs)[1].sum()) if len(rows) else 0
    return tokens, trained, docs


def labels_of(tokens: np.ndarray, trained: np.ndarray,
              docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(labels int64 (rows, width - 1) with ``IGNORE_INDEX`` where not trained, the kept
    flags): a target is kept when trained on and in the same conversation as its input."""
    keep = trained[:, 1:] & (docs[:, 1:] == docs[:, :-1])
    labels = np.where(keep, tokens[:, 1:].astype(np.int64), IGNORE_INDEX)
    return labels, keep

"""The loader of a ``chat`` folder: packed conversation rows, sharded by global step.

The same plan and cursor as ``packed_documents`` (``packed_loader.Loader``): global step ``g``
of a data epoch takes rows ``[g*GB, (g+1)*GB)`` of that epoch's order, rank ``r`` its
contiguous share; the train order is a seeded permutation per data epoch, the eval split is read
in order. A batch carries ``labels`` with ``IGNORE_INDEX`` where the loss is not taken.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from kiln.components.data.packed_loader import Loader
from kiln.components.errors import DataError

SPLIT_FILES = ("tokens", "trained", "docs")


class ChatRows:
    """Random access to a split's rows; memmaps opened lazily so workers pickle cheaply."""

    files = SPLIT_FILES  # the split's arrays: ``{split}_{name}.npy``

    def __init__(self, folder: Path, split: str, seed: int) -> None:
        self.folder, self.split, self.seed = folder, split, seed
        self._arrays: tuple[np.ndarray, ...] | None = None
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its row order)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_arrays": None, "_order": None}

    def arrays(self) -> tuple[np.ndarray, ...]:
        if self._arrays is None:
            try:
                self._arrays = tuple(np.load(self.folder / f"{self.split}_{name}.npy",
                                             mmap_mode="r", allow_pickle=False)
                                     for name in self.files)
            except (OSError, ValueError) as exc:
                raise DataError(f"{self.folder}: damaged chat data ({exc}); delete the folder "
                                "to rebuild it") from None
        return self._arrays

    def __len__(self) -> int:
        return len(self.arrays()[0])

    def batch(self, epoch: int, first: int, rows: int) -> dict[str, torch.Tensor]:
        return self.gather(self.pick(epoch, first, rows))

    def pick(self, epoch: int, first: int, rows: int) -> np.ndarray:
        """Items ``[first, first + rows)`` of the epoch's order: a seeded permutation per data
        epoch for the train split, the stored order for eval."""
        at = np.arange(first, first + rows)
        if self.split == "train":
            if self._order is None or self._order[0] != epoch:
                self._order = (epoch, np.random.default_rng([self.seed, 0x0D3, epoch])
                               .permutation(len(self)))
            at = self._order[1][at]
        return at

    def gather(self, at: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch of stored rows ``at``: inputs, labels (``IGNORE_INDEX`` where not
        trained) and document ids."""
        from kiln.components.data.chat.packing import labels_of

        tokens, trained, docs = (np.asarray(a[at]) for a in self.arrays())
        labels, _ = labels_of(tokens, trained, docs)
        return {"input_ids": torch.from_numpy(tokens[:, :-1].astype(np.int64)),
                "labels": torch.from_numpy(labels),
                "doc_ids": torch.from_numpy(np.ascontiguousarray(docs[:, :-1]))}


class ChatLoader(Loader):
    """``packed_loader.Loader``'s plan and cursor over chat rows (``windows_per_epoch`` in the
    cursor counts rows)."""

    rows_class = ChatRows  # how a batch is read from the folder
    examples = "conversations"  # what a row holds, for messages

    def unit(self) -> str:
        """What ``windows_per_epoch`` counts, for messages (packed rows of conversations)."""
        return "rows"

    def __init__(self, folder: Path, split: str, *, seq_len: int, micro_batch: int,
                 global_batch: int, rank: int, world_size: int, seed: int,
                 source: str = "") -> None:
        self._set_plan(split, seq_len, micro_batch, global_batch, rank, world_size)
        self.num_workers, self.prefetch, self.pin_memory = 0, 2, False
        self._windows = self.rows_class(folder, split, seed)  # read by Loader's micro-batches
        self.windows_per_epoch = len(self._windows)
        self.tokens_per_epoch = self.windows_per_epoch * seq_len
        self.steps_per_epoch = self.windows_per_epoch // global_batch
        if self.steps_per_epoch == 0:
            n, unit = self.windows_per_epoch, self.unit()
            unit = unit.removesuffix("s") if n == 1 else unit
            held = f"{source or folder}: the {split} split holds {n} {unit}"
            raise DataError(
                f"{held}, fewer than one global batch of {global_batch}; add "
                f"{self.examples} or lower training.global_batch" if split != "eval" else
                f"{held}, fewer than one evaluation batch of {global_batch} (training."
                f"micro_batch on every process); add {self.examples}, raise "
                "data.eval_fraction, lower training.micro_batch, or turn evaluation off "
                "(eval.interval = 0 and eval.at_end = false)")
        self._pos, self._it = 0, None

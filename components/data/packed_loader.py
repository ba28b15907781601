"""The loader of a packed-document folder: windows of an epoch's stream, sharded by global step.

A data epoch's stream is its documents concatenated in that epoch's order. Window ``w`` is
stream tokens ``[w*L, w*L + L + 1)``; inputs are its first L tokens and labels its last L.
Global step ``g`` of an epoch uses windows ``[g*GB, (g+1)*GB)``, and rank ``r`` of ``W`` takes
the contiguous slice ``[g*GB + r*GB/W, g*GB + (r+1)*GB/W)`` in micro-batches of ``mb`` rows.
Every world size therefore sees the same global batch, which is what makes a 1-process and a
2-process run compute the same loss. The incomplete last global batch of an epoch is dropped;
then the next data epoch begins (its orders cycle through those written).

The position is one integer (micro-batches served on this rank), so ``state_dict`` is a few
plain ints, and seeking is arithmetic plus one ``searchsorted`` per batch: nothing replays.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from pydantic import NonNegativeInt
from torch.utils.data import Dataset
from torchdata.stateful_dataloader import StatefulDataLoader

from kiln.components import devices
from kiln.components.data import documents
from kiln.components.data.cursor import StepCursor, check_cursor
from kiln.components.data.layout_fit import too_small
from kiln.components.data.prepare.packed_layout import (
    DAMAGED,
    TOKENS,
    PackedLayout,
    id_error,
    open_layout,
)
from kiln.components.errors import DataError, RecipeError


class PackedCursor(StepCursor):
    """What ``Loader.state_dict`` writes."""

    data_epoch: NonNegativeInt
    windows_per_epoch: NonNegativeInt


_ENDLESS = 1 << 62  # the train stream cycles data epochs forever; the trainer decides when to stop


class Windows:
    """Reads windows of a split's stream; opens the memmap lazily so workers pickle cheaply."""

    def __init__(self, layout: PackedLayout, split: str, seq_len: int) -> None:
        self.folder, self.split, self.seq_len = layout.folder, split, seq_len
        self.dtype, self.total = np.dtype(layout.meta["token_dtype"]), len(layout.tokens)
        self.num_epochs, self.vocab = layout.num_epochs, int(layout.meta["vocab_size"])
        self._layout: PackedLayout | None = layout
        self._tokens: np.ndarray | None = layout.tokens
        self._orders: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_layout": None, "_tokens": None, "_orders": {}}

    def _order(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(doc_start, cum) of a data epoch; cum (n + 1,) is where each document starts in the
        stream, so a stream position maps to a token with one searchsorted."""
        key = 0 if self.split == "eval" else epoch % self.num_epochs
        if key not in self._orders:  # keep one epoch: epochs are read in order
            start, length = self._open().order(self.split, key)
            self._orders = {key: (start, np.concatenate([[0], np.cumsum(length)]))}
        return self._orders[key]

    def _open(self) -> PackedLayout:
        if self._layout is None:  # in a worker process that was handed a pickled copy
            self._layout = open_layout(self.folder)
        return self._layout

    def stream_tokens(self) -> int:
        return int(self._order(0)[1][-1])

    def rows_per_epoch(self) -> int:
        """Windows in one data epoch of the split."""
        return (self.stream_tokens() - 1) // self.seq_len

    def read(self, epoch: int, first: int, rows: int) -> np.ndarray:
        """Windows ``first .. first+rows-1`` of ``epoch``: int64 (rows, seq_len + 1)."""
        return self.read_documents(epoch, first, rows)[0]

    def read_documents(self, epoch: int, first: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(windows int64 (rows, seq_len + 1), their inputs' ``doc_ids`` int32 (rows, seq_len)):
        the document of every stream position is known, so its boundaries come with it."""
        return self.read_rows(epoch, first + np.arange(rows))

    def read_rows(self, epoch: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``read_documents`` of any windows ``rows`` (int (n,)) of ``epoch``, in that order."""
        if self._tokens is None:
            self._tokens = np.memmap(self.folder / TOKENS, self.dtype, "r", shape=(self.total,))
        doc_start, cum = self._order(epoch)
        pos = rows[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        doc = np.searchsorted(cum, pos, side="right") - 1  # (rows, L + 1)
        at = doc_start[doc] + (pos - cum[doc])  # (rows, L + 1) offsets into tokens.bin
        out = np.asarray(self._tokens[at], dtype=np.int64)
        if out.max() >= self.vocab:  # cheap next to a forward; an embedding lookup would crash
            bad = np.argmax(out >= self.vocab)
            raise id_error(self.folder, int(out.flat[bad]), int(at.flat[bad]), self.vocab,
                           f"{DAMAGED} (`kiln data info {self.folder}` checks every token)")
        return out, documents.relative(doc[:, :-1])

    def batch(self, epoch: int, first: int, rows: int) -> dict[str, torch.Tensor]:
        """Windows ``first .. first+rows-1`` of ``epoch`` as a micro-batch."""
        w, docs = self.read_documents(epoch, first, rows)  # (mb, L + 1), (mb, L)
        return {"input_ids": torch.from_numpy(np.ascontiguousarray(w[:, :-1])),  # (mb, L)
                "labels": torch.from_numpy(np.ascontiguousarray(w[:, 1:])),  # (mb, L)
                "doc_ids": torch.from_numpy(docs)}  # (mb, L) int32, see data/documents.py


class _MicroBatches(Dataset):
    """Map-style: item ``i`` is this rank's micro-batch number ``start + i`` of the stream."""

    def __init__(self, loader: Loader, start: int, length: int) -> None:
        self.windows, self.start, self.length = loader._windows, start, length
        self.loader_plan = loader._plan()

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        try:  # the loader's rows: ``Windows`` here, ``chat_loader.ChatRows`` for chat data
            return self.windows.batch(*_locate(self.start + i, *self.loader_plan))
        except DataError as exc:  # handed over as data: raised by a worker, torch would wrap
            return {"error": str(exc)}  # it in its traceback text; `_raise_errors` raises it


def _locate(pos: int, per_step: int, steps: int, gb: int, per_rank: int, rank: int,
            mb: int) -> tuple[int, int, int]:
    """(data epoch, first window, rows) of micro-batch ``pos`` on ``rank``."""
    step, micro = divmod(pos, per_step)
    epoch, step = divmod(step, steps)
    return epoch, step * gb + rank * per_rank + micro * mb, mb


class Loader:
    """Micro-batches ``{"input_ids", "labels"}`` (LongTensor (micro_batch, seq_len)) of one rank,
    with ``doc_ids`` (int32, same shape: the document of each input token, ``data/documents.py``).

    ``prepared``: the folder came from `kiln data prepare` (data.path), not from the recipe's
    source built into the cache; it picks the advice of a split too small for one batch.

    The train loader runs forever through data epochs and continues where it is when iterated
    again; ``state_dict``/``load_state_dict`` save and restore the position exactly (with any
    ``num_workers``, and across world sizes at step boundaries). The eval loader makes one pass
    from the beginning each time it is iterated.
    """

    def __init__(self, layout: PackedLayout, split: str, *, seq_len: int, micro_batch: int,
                 global_batch: int, rank: int, world_size: int, num_workers: int = 0,
                 pin_memory: bool = False, prefetch: int = 2, prepared: bool = True) -> None:
        self._set_plan(split, seq_len, micro_batch, global_batch, rank, world_size)
        self.num_workers, self.prefetch = num_workers, prefetch
        self.pin_memory = pin_memory and devices.pin_memory_supported()
        self._windows = Windows(layout, split, seq_len)
        self.tokens_per_epoch = self._windows.stream_tokens()
        """tokens in one data epoch's stream (BOS/EOS included); a step trains on GB*L."""
        self.windows_per_epoch = (self.tokens_per_epoch - 1) // seq_len
        self.steps_per_epoch = self.windows_per_epoch // global_batch
        if self.steps_per_epoch == 0:
            raise DataError(f"{layout.folder}: " + too_small(
                layout.meta, split, seq_len=seq_len, global_batch=global_batch,
                world_size=world_size, prepared=prepared))
        self._pos = 0  # micro-batches served on this rank since data epoch 0, step 0
        self._it: Any = None

    def _set_plan(self, split: str, seq_len: int, micro_batch: int, global_batch: int,
                  rank: int, world_size: int) -> None:
        """The split and batch plan, checked (shared with the loaders built on this one)."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        _check_batch_plan(micro_batch, global_batch, rank, world_size)
        self.split, self.seq_len, self.micro_batch = split, seq_len, micro_batch
        self.global_batch, self.rank, self.world_size = global_batch, rank, world_size
        self.micro_per_step = global_batch // world_size // micro_batch

    def _plan(self) -> tuple[int, ...]:
        return (self.micro_per_step, self.steps_per_epoch, self.global_batch,
                self.global_batch // self.world_size, self.rank, self.micro_batch)

    def _dataloader(self, start: int) -> StatefulDataLoader:
        end = _ENDLESS if self.split == "train" else self.steps_per_epoch * self.micro_per_step
        workers = self.num_workers
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch.set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            # kiln's cursor (self._pos) is the checkpointed state, so the engine's own
            # snapshots are not needed: make them rare instead of one per batch.
            return StatefulDataLoader(
                _MicroBatches(self, start, max(end - start, 0)), batch_size=None,
                num_workers=workers, pin_memory=self.pin_memory, snapshot_every_n_steps=1 << 30,
                prefetch_factor=self.prefetch if workers else None,
            )

    def __iter__(self) -> Any:
        if self.split == "eval":
            return map(_raise_errors, self._dataloader(0))
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._it is None:
            self._it = iter(self._dataloader(self._pos))
        batch = _raise_errors(next(self._it))
        self._pos += 1
        return batch

    def __len__(self) -> int:
        """Micro-batches per rank in one data epoch (the whole eval pass for "eval")."""
        return self.steps_per_epoch * self.micro_per_step

    @property
    def position(self) -> tuple[int, int, int]:
        """(data epoch, global step within it, micro-batches of that step already served)."""
        step, micro = divmod(self._pos, self.micro_per_step)
        return (*divmod(step, self.steps_per_epoch), micro)

    def state_dict(self) -> dict[str, int]:
        epoch, step, micro = self.position
        return {"data_epoch": epoch, "step": step, "micro": micro,
                "seq_len": self.seq_len, "global_batch": self.global_batch,
                "micro_batch": self.micro_batch, "world_size": self.world_size,
                "windows_per_epoch": self.windows_per_epoch}

    def check_state_dict(self, state: Any) -> None:
        """DataError unless ``state`` is a cursor this loader can seek to (changes nothing)."""
        check_cursor(PackedCursor, state)
        for key in ("seq_len", "global_batch", "windows_per_epoch"):
            if int(state[key]) != getattr(self, key):
                raise DataError(
                    f"the data cursor was saved with {key} = {state[key]}, this loader has "
                    f"{getattr(self, key)}; resume with the same data and batch plan (or start "
                    "the data from the beginning)"
                )
        micro = int(state["micro"])
        if micro and (state["micro_batch"], state["world_size"]) != (self.micro_batch,
                                                                     self.world_size):
            raise DataError(
                "the data cursor was saved in the middle of a step with another micro_batch or "
                "world size; resume from a checkpoint taken at a step boundary"
            )

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Seek to a saved position; the next batch is the one that followed it."""
        self.check_state_dict(state)
        micro = state["micro"]
        step = int(state["data_epoch"]) * self.steps_per_epoch + int(state["step"])
        self._seek(step * self.micro_per_step + micro)

    def skip_steps(self, n: int) -> None:
        """Jump ``n`` global steps ahead (e.g. past the data that caused a loss spike)."""
        if n < 0:
            raise ValueError(f"skip_steps needs n >= 0, got {n}")
        self._seek(self._pos + n * self.micro_per_step)

    def _seek(self, pos: int) -> None:
        self._pos, self._it = pos, None


def _raise_errors(batch: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A batch, or the DataError a (worker's) read handed over in its place, raised here."""
    if "error" in batch:
        raise DataError(batch["error"])
    return batch


def _check_batch_plan(micro_batch: int, global_batch: int, rank: int, world_size: int) -> None:
    if min(micro_batch, global_batch, world_size) < 1 or not 0 <= rank < world_size:
        raise RecipeError(f"invalid batch plan: micro_batch={micro_batch}, global_batch="
                          f"{global_batch}, rank={rank}, world_size={world_size}")
    if global_batch % (world_size * micro_batch):
        raise RecipeError(
            f"training.global_batch = {global_batch} must be divisible by world size "
            f"{world_size} x training.micro_batch {micro_batch}; e.g. global_batch = "
            f"{world_size * micro_batch * max(1, global_batch // (world_size * micro_batch))}"
        )

"""The loader of a ``mixture`` dataset: global batches of several sources, sharded by step.

As with ``packed_documents``, global step ``g`` uses global sequence positions
``[g*GB, (g+1)*GB)`` and rank ``r`` of ``W`` takes the contiguous slice
``[g*GB + r*GB/W, ...)`` in micro-batches, so every world size sees the same global batches.
Position ``j``'s source comes from ``mixture.order`` (counted from its stage's start); its row
is the number of sequences that source gave before ``j``. Those per-source counts at the start
of the current step are the cursor (``state_dict``): at a step boundary they are the same on
every rank and for every world size, so an elastic resume continues exactly.

Train batches carry ``source_ids`` (int64 (micro_batch,): the source of each row, in the
dataset's sorted source order) besides ``input_ids``, ``labels`` and ``doc_ids``; the trainer
logs loss and tokens per source from them. Reads are memory-map gathers in the training thread,
a block of up to 16 steps at once (one gather per source; docs/benchmarks.md "mixture loader").
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
from pydantic import NonNegativeInt

from kiln.components.data.cursor import StepCursor, check_cursor
from kiln.components.data.mixture import order as mixture_order
from kiln.components.errors import DataError, RecipeError

_AHEAD_STEPS = 16  # steps read ahead at most, and at most this many tokens of one rank:
_AHEAD_TOKENS = 1 << 21  # 16 MiB of int64 windows


class _Block(NamedTuple):
    """Global steps ``[start, stop)`` of one rank, read at once (``_read_block``)."""

    start: int
    stop: int
    before: np.ndarray  # (stop - start + 1, sources): counts before each step, all ranks
    inputs: torch.Tensor  # (steps x rows per rank, seq_len) int64, as are labels
    labels: torch.Tensor
    docs: torch.Tensor  # int32 doc_ids
    src: torch.Tensor  # int64 source of each row


class MixtureCursor(StepCursor):
    """What ``MixtureLoader.state_dict`` writes."""

    sources: list[str]
    rows_before_step: dict[str, NonNegativeInt]


class MixtureLoader:
    """Micro-batches of one rank: endless for "train", one pass per iteration for "eval"."""

    steps_per_epoch = None  # a mixture is endless: the recipe sets training.steps or tokens

    def __init__(self, ds: Any, split: str, *, micro_batch: int, global_batch: int, rank: int,
                 world_size: int, source: str | None = None) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if global_batch % (world_size * micro_batch) or not 0 <= rank < world_size:
            raise RecipeError(f"training.global_batch = {global_batch} must be divisible by "
                              f"world size {world_size} x training.micro_batch {micro_batch}")
        self.ds, self.split, self.seq_len = ds, split, ds.seq_len
        self.micro_batch, self.global_batch = micro_batch, global_batch
        self.rank, self.world_size = rank, world_size
        self.micro_per_step = global_batch // world_size // micro_batch
        self.names = list(ds.names)
        self._pos = 0
        self._cached: tuple[int, np.ndarray] = (0, np.zeros(len(self.names), dtype=np.int64))
        self._block: _Block | None = None  # the steps being handed out (``_read_block``)
        per_step = global_batch // world_size * (self.seq_len + 1)
        self._ahead = max(1, min(_AHEAD_STEPS, _AHEAD_TOKENS // per_step))
        self._caps = {n: ds.row_cap(n) for n in self.names} if split == "train" else {}
        self._wins = {n: ds.windows(n, split) for n in self.names}
        self.eval_sources = [source] if source is not None else self.names
        if split == "eval":
            for name in self.eval_sources:
                if self._wins[name] < global_batch:
                    raise DataError(
                        f"data.sources.{name}: its eval split holds {self._wins[name]} "
                        f"sequences of {self.seq_len} tokens, fewer than one eval batch "
                        f"({global_batch}: micro_batch x data-parallel ranks); give the source "
                        "more text or a larger eval_fraction, or lower training.micro_batch")

    # ------------------------------------------------------------------------------ train
    def counts_at(self, step: int) -> np.ndarray:
        """Sequences each source gave before global step ``step`` (cached: steps go in order)."""
        b = self._block
        if b is not None and b.start <= step <= b.stop:
            return b.before[step - b.start]
        at, counts = self._cached
        if step == at + 1:
            counts = counts + self.ds.step_counts(at, self.global_batch)
        elif step != at:
            counts = self.ds.counts_before(step, self.global_batch)
        self._cached = (step, counts)
        return counts

    def source_counts(self) -> dict[str, int]:
        """Sequences each source gave in the steps this loader has completed (all ranks)."""
        step = -(-self._pos // self.micro_per_step)  # a step begun counts once it is done
        return dict(zip(self.names, self.counts_at(step).tolist(), strict=True))

    def _read_block(self, step: int, most: int) -> _Block:
        """This rank's rows of global steps ``step ..`` (at most ``most``, within one stage),
        one gather per source: per-call costs (index arithmetic, memmap gathers, tensor
        copies) are paid once per block, not once per source and micro-batch."""
        stage, gb = self.ds.stage_of(step), self.global_batch
        later = [s.step for s in self.ds.stages if s.step > step]
        k = min(most, (later[0] if later else step + most) - step)
        before = self.counts_at(step)
        rel = (step - stage.step) * gb  # the block's start within its stage
        src, rows = mixture_order.rows_within(np.arange(rel, rel + k * gb, dtype=np.uint64),
                                              stage.weights, self.ds.seed, before, stage.index)
        n = len(self.names)
        per_step = np.bincount(src + n * (np.arange(k * gb) // gb), minlength=k * n)
        after = before + np.cumsum(per_step.reshape(k, n), axis=0)
        caps = [self._caps.get(name) for name in self.names]
        if k > 1 and any(cap is not None and after[-1][i] > cap for i, cap in enumerate(caps)):
            return self._read_block(step, 1)  # read ahead never raises for a step not trained
        per_rank = gb // self.world_size
        idx = (np.arange(k)[:, None] * gb + self.rank * per_rank + np.arange(per_rank)).ravel()
        mine, mine_rows = src[idx], rows[idx]
        out = np.empty((len(idx), self.seq_len + 1), dtype=np.int64)
        docs = np.empty((len(idx), self.seq_len), dtype=np.int32)
        for i in np.unique(mine):
            mask = mine == i
            out[mask], docs[mask] = self._read(self.names[i], mine_rows[mask])
        t = torch.from_numpy(out)
        return _Block(step, step + k, np.concatenate([before[None], after]),
                      t[:, :-1].contiguous(), t[:, 1:].contiguous(), torch.from_numpy(docs),
                      torch.from_numpy(mine))

    def _train_batch(self, pos: int) -> dict[str, torch.Tensor]:
        step, micro = divmod(pos, self.micro_per_step)
        b = self._block
        if b is None or not b.start <= step < b.stop:
            b = self._block = self._read_block(step, self._ahead)
        first = ((step - b.start) * self.micro_per_step + micro) * self.micro_batch
        part = slice(first, first + self.micro_batch)
        return {"input_ids": b.inputs[part], "labels": b.labels[part], "doc_ids": b.docs[part],
                "source_ids": b.src[part]}

    def _read(self, name: str, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Train ``rows`` (ascending) of source ``name``, grouped by data epoch."""
        cap = self._caps.get(name)
        if cap is not None and rows[-1] >= cap:
            raise DataError(
                f"data.sources.{name}: row {int(rows[-1])} is past data.max_epochs.{name} = "
                f"{self.ds.cfg.max_epochs[name]:g} epochs of {self._wins[name]} sequences; lower "
                "its weight, raise the cap, or set data.on_exhausted = \"repeat\"")
        reader, per_epoch = self.ds.reader(name, "train"), self._wins[name]
        epochs, at = np.divmod(rows, per_epoch)
        if epochs[0] == epochs[-1]:
            return reader.read_rows(int(epochs[0]), at)
        parts = [reader.read_rows(int(e), at[epochs == e]) for e in np.unique(epochs)]
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def __iter__(self) -> Any:
        if self.split == "eval":
            return self._eval_batches()
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        batch = self._train_batch(self._pos)
        self._pos += 1
        return batch

    # ------------------------------------------------------------------------------- eval
    def _eval_batches(self):
        per_rank = self.global_batch // self.world_size
        for name in self.eval_sources:
            reader = self.ds.reader(name, "eval")
            for b in range(self._wins[name] // self.global_batch):
                for m in range(self.micro_per_step):
                    first = b * self.global_batch + self.rank * per_rank + m * self.micro_batch
                    w, docs = reader.read_documents(0, first, self.micro_batch)
                    yield _batch(w, docs, None)

    def __len__(self) -> int:
        """Micro-batches of one eval pass on this rank (the train stream is endless)."""
        if self.split == "train":
            raise TypeError("a mixture's train stream is endless")
        return sum(self._wins[n] // self.global_batch for n in self.eval_sources) \
            * self.micro_per_step

    # ----------------------------------------------------------------------------- cursor
    def skip_steps(self, n: int) -> None:
        """Jump ``n`` global steps ahead (e.g. past the data that caused a loss spike)."""
        if n < 0:
            raise ValueError(f"skip_steps needs n >= 0, got {n}")
        self._pos += n * self.micro_per_step
        self._block = None

    def state_dict(self) -> dict[str, Any]:
        step, micro = divmod(self._pos, self.micro_per_step)
        rows = dict(zip(self.names, self.counts_at(step).tolist(), strict=True))
        return {"step": step, "micro": micro, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "micro_batch": self.micro_batch,
                "world_size": self.world_size, "sources": self.names, "rows_before_step": rows}

    def check_state_dict(self, state: Any) -> None:
        """DataError unless ``state`` is a cursor this loader can seek to (changes nothing)."""
        check_cursor(MixtureCursor, state)
        for key in ("seq_len", "global_batch"):
            if state[key] != getattr(self, key):
                raise DataError(f"the data cursor was saved with {key} = {state[key]}, this "
                                f"loader has {getattr(self, key)}; resume with the same batch "
                                "plan")
        if state["sources"] != self.names or sorted(state["rows_before_step"]) != self.names:
            raise DataError(f"the data cursor holds sources {state['sources']}, this mixture "
                            f"has {self.names}; resume with the same sources")
        if state["micro"] and (state["micro_batch"], state["world_size"]) != (
                self.micro_batch, self.world_size):
            raise DataError("the data cursor was saved in the middle of a step with another "
                            "micro_batch or world size; resume from a step boundary")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Seek to a saved position: the carried counts, not a recount from step 0."""
        self.check_state_dict(state)
        step = int(state["step"])
        counts = np.array([state["rows_before_step"][n] for n in self.names], dtype=np.int64)
        self._cached, self._block = (step, counts), None
        self._pos = step * self.micro_per_step + int(state["micro"])


def _batch(windows: np.ndarray, docs: np.ndarray, src: torch.Tensor | None
           ) -> dict[str, torch.Tensor]:
    """``docs``: each row's ``doc_ids`` already (``data/documents.py``, from the reader)."""
    t = torch.from_numpy(np.ascontiguousarray(windows))
    batch = {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(),
             "doc_ids": torch.from_numpy(np.ascontiguousarray(docs))}
    if src is not None:
        batch["source_ids"] = src
    return batch

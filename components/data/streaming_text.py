"""The ``streaming_text`` dataset: tokenises its inputs on the fly, for corpora too big to
prepare. Same inputs as ``kiln data prepare`` (files, folders, globs, saved datasets, Hub
datasets read file by file); documents packed into windows as in ``packed_documents``.

Global-batch semantics and sharding: see ``stream_lanes`` (row ``i`` of every global step comes
from lane ``i``, so 1 and N processes see the same global batches; ranks and loader workers
each read the inputs but tokenise only their own lanes' documents). The train loader is a
``torchdata`` ``StatefulDataLoader`` whose state (each worker's lane positions, JSON) resumes
exactly: the same next batch, without re-tokenising what was consumed. Document order is the
inputs' order (no shuffle: shuffle a corpus when writing it, or use ``kiln data prepare``).
The first ``eval_docs`` documents are the eval split and are never trained on.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
import xxhash
from pydantic import Field, NonNegativeInt
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from kiln.components import devices
from kiln.components.base import ComponentConfig
from kiln.components.data import documents
from kiln.components.data.cursor import PlanCursor, check_cursor
from kiln.components.data.packed_loader import _check_batch_plan
from kiln.components.data.stream_lanes import DocReader, Lanes, eval_texts, skipped
from kiln.components.errors import DataError, RecipeError
from kiln.components.protocols import DatasetContract
from kiln.components.registry import register
from kiln.components.sources.text_sources import ReadStats, expand_inputs


class StreamingTextConfig(ComponentConfig):
    """Text tokenised while training: files, folders, globs, saved or Hub datasets."""

    inputs: list[str] = Field(default_factory=list, description="files, folders, globs, saved "
                              'HF datasets, "hf://datasets/owner/name" or "stdlib"')
    text_field: str = Field("text", description="JSONL field / column holding the text")
    split: str = Field("train", description="split of a saved DatasetDict or Hub dataset")
    hf_config: str = Field("", description="config (subset) of a Hub dataset")
    cache_dir: str = Field("", description='Hub cache folder ("" = the HF default)')
    on_invalid_utf8: str = Field("skip", pattern="^(skip|fail)$",
                                 description="skip (and count) or fail on non-UTF-8 documents")
    eval_docs: int = Field(64, ge=0, description="the first N documents: the eval split")
    batch_docs: int = Field(64, ge=1, description="documents per encode_batch call per reader")
    num_workers: int = Field(0, ge=0, description="loader processes per rank (must divide the "
                             "micro-batches per step)")
    prefetch: int = Field(2, ge=1, description="micro-batches each worker loads ahead")


class _LaneStream(IterableDataset):
    """This rank's micro-batches; a loader worker makes the micro-batch slots it owns."""

    def __init__(self, ds: StreamingText, *, micro_batch: int, global_batch: int, rank: int,
                 world_size: int) -> None:
        self.ds, self.mb, self.gb = ds, micro_batch, global_batch
        self.per_rank = global_batch // world_size
        self.slots = self.per_rank // micro_batch
        self.base = rank * self.per_rank
        self._state: dict[str, Any] | None = None
        self._turn = 0
        self._lanes: Lanes | None = None

    def _own_slots(self) -> list[int]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        return list(range(worker, self.slots, workers))

    def __iter__(self):
        slots = self._own_slots()
        lanes = [self.base + s * self.mb + i for s in slots for i in range(self.mb)]
        self._lanes = Lanes(lanes, self.gb, self.ds.seq_len, DocReader(
            self.ds.files, self.ds.read_opts, self.ds.cfg.eval_docs), self.ds.tokenizer,
            self.ds.cfg.batch_docs, self._state)
        turn = self._turn  # the next of this worker's slots, round after round
        while True:
            s = slots[turn]
            windows = [self._lanes.window(self.base + s * self.mb + i) for i in range(self.mb)]
            turn = (turn + 1) % len(slots)
            self._state, self._turn = self._lanes.state_dict(), turn
            t = torch.from_numpy(np.stack([w for w, _ in windows]))  # (mb, L + 1)
            yield {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(),
                   "doc_ids": torch.from_numpy(np.stack([d for _, d in windows]))}

    def state_dict(self) -> dict[str, Any]:
        return {"lanes": self._state, "turn": self._turn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._state, self._turn = state["lanes"], int(state["turn"])


class StreamCursor(PlanCursor):
    """What ``StreamLoader.state_dict`` writes: the batch plan and the StatefulDataLoader's own
    state (torchdata's format, checked by torchdata when loaded)."""

    rank: NonNegativeInt
    num_workers: NonNegativeInt
    loader: dict[str, Any]


class StreamLoader:
    """Micro-batches ``{"input_ids", "labels"}`` (LongTensor (micro_batch, seq_len)) and their
    ``doc_ids`` (``data/documents.py``) of one rank's train stream; endless. ``state_dict`` is
    the StatefulDataLoader's (JSON-able)."""

    steps_per_epoch = None  # endless stream: the recipe sets training.steps or tokens

    def __init__(self, ds: StreamingText, *, micro_batch: int, global_batch: int, rank: int,
                 world_size: int) -> None:
        _check_batch_plan(micro_batch, global_batch, rank, world_size)
        self.plan = {"seq_len": ds.seq_len, "global_batch": global_batch,
                     "micro_batch": micro_batch, "world_size": world_size, "rank": rank,
                     "num_workers": ds.cfg.num_workers}
        self.micro_per_step = global_batch // world_size // micro_batch
        workers = ds.cfg.num_workers
        if workers and self.micro_per_step % workers:
            raise RecipeError(
                f"data.num_workers = {workers} must divide the micro-batches per step per rank "
                f"({self.micro_per_step}): each worker owns whole micro-batch slots (lanes)")
        self.dataset = _LaneStream(ds, micro_batch=micro_batch, global_batch=global_batch,
                                   rank=rank, world_size=world_size)
        with warnings.catch_warnings():  # torchdata 0.11 calls a deprecated torch.set_vital
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self.loader = StatefulDataLoader(
                self.dataset, batch_size=None, num_workers=workers, snapshot_every_n_steps=1,
                prefetch_factor=ds.cfg.prefetch if workers else None,
                pin_memory=devices.pin_memory_supported(), persistent_workers=False)
        self._it: Any = None

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._it is None:
            self._it = iter(self.loader)
        return next(self._it)

    def skip_steps(self, n: int) -> None:
        """Jump ``n`` global steps ahead: tokenises through them (positions are in tokens)."""
        for _ in range(n * self.micro_per_step):
            next(self)

    def state_dict(self) -> dict[str, Any]:
        return {**self.plan, "loader": self.loader.state_dict()}

    def check_state_dict(self, state: Any) -> None:
        """DataError unless ``state`` is a cursor this loader can resume (changes nothing)."""
        check_cursor(StreamCursor, state)
        for key, value in self.plan.items():
            if state.get(key) != value:
                raise DataError(
                    f"the streaming data cursor was saved with {key} = {state.get(key)}, this "
                    f"loader has {value}; resume with the same batch plan, world size and "
                    "data.num_workers (or start the data from the beginning)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.loader.load_state_dict(state["loader"])
        self._it = None


class _EvalLoader:
    """One pass over the eval documents packed into windows, this rank's slice of each batch."""

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch: int, rank: int,
                 world_size: int, bos_id: int) -> None:
        self.tokens, self.seq_len, self.mb, self.bos_id = tokens, seq_len, micro_batch, bos_id
        self.rank, self.world = rank, world_size
        self.batches = (len(tokens) - 1) // seq_len // (micro_batch * world_size)
        if self.batches == 0:
            raise DataError(f"the eval split ({len(tokens)} tokens in data.eval_docs documents) "
                            f"is shorter than one eval batch ({micro_batch * world_size} x "
                            f"{seq_len}); raise data.eval_docs or set eval.interval = 0")

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        for b in range(self.batches):
            first = (b * self.world + self.rank) * self.mb
            pos = (first + np.arange(self.mb))[:, None] * self.seq_len + np.arange(
                self.seq_len + 1)
            rows = self.tokens[pos].astype(np.int64)  # (mb, L + 1)
            t = torch.from_numpy(rows)
            yield {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous(),
                   "doc_ids": torch.from_numpy(documents.from_bos(rows[:, :-1], self.bos_id))}


@register("dataset", "streaming_text")
class StreamingText(DatasetContract):
    """Text tokenised on the fly (no prepare step); exact resume; for very large corpora."""

    Config = StreamingTextConfig

    def __init__(self, cfg: StreamingTextConfig, *, tokenizer: Any, seq_len: int,
                 seed: int = 0, **context: Any) -> None:
        if not cfg.inputs:
            raise RecipeError('streaming_text needs data.inputs, e.g. inputs = ["corpus/*.jsonl"]')
        self.cfg, self.tokenizer, self.seq_len = cfg, tokenizer, seq_len
        self.read_opts = {"text_field": cfg.text_field, "on_invalid_utf8": cfg.on_invalid_utf8}
        self.files: list[Any] = []
        self._eval: tuple[np.ndarray, float] | None = None

    def prepare(self, *, create: bool = False) -> None:
        """List the inputs (Hub listings included); nothing is written."""
        if not self.files:
            self.files = expand_inputs(self.cfg.inputs, split=self.cfg.split,
                                       config=self.cfg.hf_config, cache_dir=self.cfg.cache_dir)

    def _eval_split(self) -> tuple[np.ndarray, float]:
        if self._eval is None:
            self.prepare()
            stats = ReadStats()
            texts = eval_texts(self.files, self.read_opts, self.cfg.eval_docs, stats)
            if not texts and not self.cfg.eval_docs:
                raise DataError("data.eval_docs = 0: streaming_text has no eval split; set "
                                "eval_docs > 0 or eval.interval = 0 and eval.at_end = false")
            if not texts:
                raise DataError(f"data.inputs hold no document to hold out for evaluation "
                                f"(data.eval_docs = {self.cfg.eval_docs}){skipped(stats)}; "
                                "check data.inputs and data.text_field")
            ids = self.tokenizer.encode_batch(texts)
            tokens = np.concatenate([np.concatenate([[self.tokenizer.bos_id], a,
                                                     [self.tokenizer.eos_id]]) for a in ids])
            self._eval = tokens, len(tokens) / max(sum(len(t.encode()) for t in texts), 1)
        return self._eval

    def eval_fingerprints(self) -> dict[str, str]:
        """The held-out tokens (the first ``eval_docs`` documents), hashed: runs on other
        inputs are not judged against each other."""
        if not self.cfg.eval_docs:
            return {}
        return {"data": xxhash.xxh3_64_hexdigest(np.ascontiguousarray(self._eval_split()[0]))}

    def tokens_per_byte(self, split: str = "eval") -> float | None:
        """Tokens per UTF-8 byte of the eval documents (for bits per byte)."""
        return self._eval_split()[1] if split == "eval" and self.cfg.eval_docs else None

    def loader(self, split: str, *, micro_batch: int, global_batch: int, rank: int = 0,
               world_size: int = 1) -> Any:
        self.prepare()
        if split == "eval":
            return _EvalLoader(self._eval_split()[0], self.seq_len, micro_batch, rank,
                               world_size, self.tokenizer.bos_id)
        if split != "train":
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        return StreamLoader(self, micro_batch=micro_batch, global_batch=global_batch, rank=rank,
                            world_size=world_size)

"""The ``balanced_shards`` dataset: several named domains of pre-tokenised ``.npy`` shards,
interleaved so that every domain contributes the same number of tokens.

Shard layout and sources (local folder or Hugging Face Hub): see ``shard_source``. Each domain
is an endless stream of rows: its shards in a seeded random order (a new order each pass), the
rows of each shard in a seeded random permutation. Whenever a stream moves on to its next shard
it lists the domain again, and shards it has not seen join the current pass, so data uploaded
while training is used without a restart (ranks list independently: a shard that appears while
ranks are listing may reach them a shard apart — harmless, but not bit-reproducible).

Global row ``j`` is row ``j // D`` of domain ``j % D`` (D domains): any D consecutive rows hold
one of each, hence equal tokens per domain. As in ``packed_documents``, global step ``g`` uses
rows ``[g*GB, (g+1)*GB)`` and rank ``r`` of ``W`` takes the contiguous slice
``[g*GB + r*GB/W, g*GB + (r+1)*GB/W)`` in micro-batches; so every world size sees the same
global batches. The first ``eval_rows`` rows of each domain's first shard (by name) are held out
for the ``eval`` split and never trained on.

The position is a plain dict (``state_dict``): the micro-batch cursor plus, per domain, the
shards in stream order with their row counts, the pass queue and the shards seen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
from pydantic import Field

from kiln.components import devices
from kiln.components.base import ComponentConfig
from kiln.components.data import documents
from kiln.components.data.cursor import StepCursor, check_cursor
from kiln.components.data.prefetch import Prefetcher
from kiln.components.data.shard_rows import DomainCursor, DomainStream, ShardRows
from kiln.components.data.shard_source import (
    FolderSource,
    HubSource,
    Shard,
    read_shards_json,
)
from kiln.components.errors import DataError, RecipeError
from kiln.components.protocols import DatasetContract
from kiln.components.registry import register


class BalancedShardsConfig(ComponentConfig):
    """Domains of .npy token shards, balanced to equal tokens per domain."""

    path: str = Field("", description="local source: root holding one sub-folder per domain")
    repo_id: str = Field(
        "", description='Hub source (used when set): dataset repository, e.g. "org/name"'
    )
    prefix: str = Field("data", description="hub source: folder in the repo holding the domains")
    revision: str = Field("", description='hub source: branch, tag or commit ("" = main)')
    cache_dir: str = Field("", description='hub source: Hub cache folder ("" = HF default)')
    local_files_only: bool = Field(
        False, description="hub source: never go online; list and read the cached snapshot"
    )
    domains: list[str] = Field(
        default_factory=lambda: ["code", "general", "math", "reasoning"], min_length=1,
        description="domain sub-folders, each contributing the same number of tokens",
    )
    eval_rows: int = Field(
        64, ge=0, description="rows per domain held out for eval (from its first shard by name)"
    )
    shuffle: bool = Field(True, description="seeded random shard order and row order")
    refresh: bool = Field(True, description="list the domain again before each new shard")
    prefetch: int = Field(
        4, ge=0, description="train micro-batches read (and Hub shards downloaded) ahead in a "
        "background thread; 0 = in the training thread",
    )
    pin_memory: bool = Field(
        True, description="prefetched batches in page-locked memory when CUDA is available "
        "(asynchronous host-to-GPU copies)",
    )


class BalancedCursor(StepCursor):
    """What the train loader's ``state_dict`` writes."""

    domains: list[str]
    streams: dict[str, DomainCursor]


@register("dataset", "balanced_shards")
class BalancedShards(DatasetContract):
    """Pre-tokenised .npy shards of several domains, equal tokens per domain, streamed."""

    Config = BalancedShardsConfig

    def __init__(self, cfg: BalancedShardsConfig, *, tokenizer: Any = None, seq_len: int,
                 seed: int = 0, **context: Any) -> None:
        self.cfg, self.seq_len, self.seed, self.tokenizer = cfg, seq_len, seed, tokenizer
        if len(set(cfg.domains)) != len(cfg.domains):
            raise RecipeError(f"data.domains lists a domain twice: {cfg.domains}")
        if cfg.repo_id and cfg.path:
            raise RecipeError("balanced_shards: set data.path (a local folder) or data.repo_id "
                              "(a Hub dataset), not both")
        if cfg.repo_id:
            self.source: Any = HubSource(cfg.repo_id, cfg.prefix, cfg.revision, cfg.cache_dir,
                                         cfg.local_files_only)
        elif cfg.path:
            self.source = FolderSource(cfg.path)
        else:
            raise RecipeError("balanced_shards needs data.path (a folder holding one sub-folder "
                              'of .npy shards per domain) or data.repo_id (e.g. "org/dataset")')
        self.eval_shard: dict[str, str] = {}

    @property
    def folder(self) -> Path:
        return Path(self.source.where)

    def shard(self, name: str) -> Shard:
        vocab = self.tokenizer.vocab_size if self.tokenizer is not None else 0
        return Shard(self.source.fetch(name), self.seq_len, f"{self.source.where}/{name}",
                     vocab)

    def held_out(self, domain: str, name: str) -> int:
        return self.cfg.eval_rows if self.eval_shard.get(domain) == name else 0

    def prepare(self, *, create: bool = False) -> Path:
        """List every domain, pick its eval shard and check that it opens; no copy is made."""
        for d in self.cfg.domains:
            names = self.source.list(d)
            if not names:
                raise DataError(f"{self.source.where}/{d}: no .npy shards for domain {d!r}; "
                                f"domains: {self.cfg.domains}")
            self._check_tokenizer(d)
            first = self.shard(names[0])
            if self.cfg.eval_rows:
                if first.rows <= self.cfg.eval_rows:
                    raise DataError(f"{first.name}: {first.rows} rows, not more than eval_rows "
                                    f"= {self.cfg.eval_rows}; lower data.eval_rows")
                self.eval_shard[d] = names[0]
        return self.folder

    def _check_tokenizer(self, domain: str) -> None:
        """Shards written by `kiln data prepare --domain` record their tokenizer: check it."""
        info = Path(self.source.where) / domain / "shards.json"
        if self.tokenizer is None or not isinstance(self.source, FolderSource) or \
                not info.is_file():
            return
        meta = read_shards_json(info.parent)
        if meta.get("tokenizer") != self.tokenizer.fingerprint():
            ours = getattr(self.tokenizer, "source", "") or type(self.tokenizer).__name__
            raise DataError(
                f"{info.parent}: shards tokenized by {meta.get('tokenizer_source')} "
                f"({meta.get('tokenizer')}), but the recipe's tokenizer is {ours} "
                f"({self.tokenizer.fingerprint()}); set [tokenizer] to the one the shards were "
                "built with, or rebuild them with `kiln data prepare --domain`"
            )

    @property
    def meta(self) -> dict[str, Any]:
        return {"domains": self.cfg.domains, "source": self.source.where,
                "eval_shards": dict(self.eval_shard)}

    def eval_fingerprints(self) -> dict[str, str]:
        """The held-out rows themselves (each domain's first ``eval_rows`` rows of its eval
        shard), hashed: runs on other shards are not judged against each other."""
        if not self.cfg.eval_rows:
            return {}
        if not self.eval_shard:
            self.prepare()
        rows = xxhash.xxh3_64()
        for d in self.cfg.domains:
            rows.update(self.shard(self.eval_shard[d]).read(np.arange(self.cfg.eval_rows)))
        return {"data": rows.hexdigest()}

    def rows(self, split: str) -> ShardRows:
        """``split``'s rows by number: how a ``mixture`` reads it as a source (``shard_rows``)."""
        return ShardRows(self, split)

    def loader(self, split: str, *, micro_batch: int, global_batch: int, rank: int = 0,
               world_size: int = 1) -> BalancedLoader:
        if not self.eval_shard and self.cfg.eval_rows:
            self.prepare()
        return BalancedLoader(self, split, micro_batch=micro_batch, global_batch=global_batch,
                              rank=rank, world_size=world_size)


class BalancedLoader:
    """Micro-batches ``{"input_ids", "labels"}`` (int64 (micro_batch, seq_len)) of one rank, with
    ``doc_ids`` from the BOS tokens when the dataset has a tokenizer (``data/documents.py``).

    ``train`` runs forever and resumes from ``state_dict``; ``eval`` is one pass over the held-out
    rows each time it is iterated. ``train`` batches are made ``prefetch`` micro-batches ahead
    in a background thread (``prefetch.Prefetcher``); the position and stream states reported by
    ``state_dict`` are those after the last batch handed out, not after the read-ahead.
    """

    steps_per_epoch = None  # endless stream: the recipe sets training.steps or tokens

    def __init__(self, ds: BalancedShards, split: str, *, micro_batch: int, global_batch: int,
                 rank: int, world_size: int) -> None:
        if split not in ("train", "eval"):
            raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
        if global_batch % (world_size * micro_batch) or not 0 <= rank < world_size:
            raise RecipeError(
                f"training.global_batch = {global_batch} must be divisible by world size "
                f"{world_size} x training.micro_batch {micro_batch}"
            )
        self.ds, self.split, self.seq_len = ds, split, ds.seq_len
        self.micro_batch, self.global_batch = micro_batch, global_batch
        self.rank, self.world_size = rank, world_size
        self.micro_per_step = global_batch // world_size // micro_batch
        self.domains = list(ds.cfg.domains)
        self.streams = {d: DomainStream(ds, d) for d in self.domains}
        self._pos = 0
        self._prefetcher: Prefetcher | None = None
        self._ahead = 0  # the next position the prefetch thread makes
        self._streams_state: dict[str, Any] | None = None  # after the last batch handed out
        if split == "eval" and not ds.cfg.eval_rows:
            raise DataError("data.eval_rows = 0: balanced_shards has no eval split; set "
                            "eval_rows > 0 or eval.interval = 0")

    def _rows(self, first: int) -> np.ndarray:
        d = len(self.domains)
        j = first + np.arange(self.micro_batch)  # global row numbers
        dom, k = j % d, j // d
        out = np.empty((self.micro_batch, self.seq_len + 1), dtype=np.int64)
        step_start = (first // self.global_batch) * self.global_batch // d
        for i, name in enumerate(self.domains):
            mask = dom == i
            if mask.any():
                if self.split == "eval":
                    shard = self.ds.shard(self.ds.eval_shard[name])
                    out[mask] = shard.read(k[mask])
                else:
                    out[mask] = self.streams[name].rows(k[mask], keep_from=step_start)
        return out

    def _first_row(self, pos: int) -> int:
        step, micro = divmod(pos, self.micro_per_step)
        return step * self.global_batch + self.rank * (self.global_batch // self.world_size) \
            + micro * self.micro_batch

    def _batch(self, pos: int) -> dict[str, torch.Tensor]:
        rows = self._rows(self._first_row(pos))  # (mb, L + 1)
        t = torch.from_numpy(rows)
        batch = {"input_ids": t[:, :-1].contiguous(), "labels": t[:, 1:].contiguous()}
        bos = getattr(self.ds.tokenizer, "bos_id", None)
        if bos is not None:  # shards hold bare ids: documents start at BOS (kiln's writers)
            batch["doc_ids"] = torch.from_numpy(documents.from_bos(rows[:, :-1], bos))
        return batch

    def __len__(self) -> int:
        if self.split == "train":
            raise TypeError("the balanced_shards train stream is endless")
        return self.ds.cfg.eval_rows * len(self.domains) // self.global_batch * self.micro_per_step

    def __iter__(self):
        if self.split == "eval":
            return (self._batch(p) for p in range(len(self)))
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if not self.ds.cfg.prefetch:
            batch = self._batch(self._pos)
            self._pos += 1
            return batch
        if self._prefetcher is None:
            self._ahead = self._pos
            self._streams_state = self._stream_states()
            pin = self.ds.cfg.pin_memory and devices.pin_memory_supported()
            self._prefetcher = Prefetcher(self._produce, self.ds.cfg.prefetch, pin)
        batch, (self._pos, self._streams_state) = self._prefetcher.get()
        return batch

    def _produce(self) -> tuple[dict[str, torch.Tensor], tuple[int, dict[str, Any]]]:
        """In the prefetch thread: the next batch and the loader state right after it."""
        batch = self._batch(self._ahead)
        self._ahead += 1
        return batch, (self._ahead, self._stream_states())

    def _stream_states(self) -> dict[str, Any]:
        return {d: s.state_dict() for d, s in self.streams.items()}

    def close(self) -> None:
        """Stop the read-ahead; the streams go back to where the handed-out batches left them."""
        if self._prefetcher is not None:
            self._prefetcher.close()
            self._prefetcher = None
            for d, s in (self._streams_state or {}).items():
                self.streams[d].load_state_dict(s)

    def skip_steps(self, n: int) -> None:
        """Jump ``n`` global steps ahead (e.g. past the data that caused a loss spike)."""
        if n < 0:
            raise ValueError(f"skip_steps needs n >= 0, got {n}")
        self.close()
        self._pos += n * self.micro_per_step

    def state_dict(self) -> dict[str, Any]:
        step, micro = divmod(self._pos, self.micro_per_step)
        streams = self._streams_state if self._prefetcher is not None else self._stream_states()
        return {"step": step, "micro": micro, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "micro_batch": self.micro_batch,
                "world_size": self.world_size, "domains": self.domains, "streams": streams}

    def check_state_dict(self, state: Any) -> None:
        """DataError unless ``state`` is a cursor this loader can seek to (changes nothing)."""
        check_cursor(BalancedCursor, state)
        for key in ("seq_len", "global_batch", "domains"):
            if state[key] != getattr(self, key):
                raise DataError(f"the data cursor was saved with {key} = {state[key]}, this "
                                f"loader has {getattr(self, key)}; resume with the same data "
                                "settings and batch plan")
        micro = int(state["micro"])
        if micro and (state["micro_batch"], state["world_size"]) != (self.micro_batch,
                                                                     self.world_size):
            raise DataError("the data cursor was saved in the middle of a step with another "
                            "micro_batch or world size; resume from a step boundary")
        if sorted(state["streams"]) != sorted(self.domains):
            raise DataError(f"the data cursor holds streams {sorted(state['streams'])}, this "
                            f"loader reads domains {sorted(self.domains)}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.close()
        micro = state["micro"]
        for d, s in state["streams"].items():
            self.streams[d].load_state_dict(s)
        self._pos = int(state["step"]) * self.micro_per_step + micro

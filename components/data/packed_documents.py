"""The ``packed_documents`` dataset: documents packed into seq_len windows, built once, cached.

With ``path = ""`` the configured source (by default the Python standard library of the
running machine, so a recipe trains with no download) is tokenized into
``$KILN_CACHE/packed/<source>-<key>``, where the key hashes everything that changes the bytes
written; a second run reuses the folder. The trainer calls ``prepare()`` on rank 0, then a
barrier, then on the other ranks, which only validate; a file lock and an atomic rename make
concurrent calls safe anyway.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.caching import cache_root  # noqa: F401 - kept importable here
from kiln.components.data.corpus import open_corpus
from kiln.components.data.packed_loader import Loader, Windows
from kiln.components.data.prepare.packed_layout import (
    PackedLayout,
    Tokenizer,
    file_lock,
    open_layout,
    write_layout,
)
from kiln.components.data.prepare.packed_layout import eval_fingerprint as layout_eval_fingerprint
from kiln.components.data.prepare.packed_layout import fingerprint as layout_fingerprint
from kiln.components.data.prepare.splits import SPLIT_SEED
from kiln.components.errors import DataError
from kiln.components.protocols import DatasetContract
from kiln.components.registry import register


class PackedDocumentsConfig(ComponentConfig):
    """Where the packed documents come from and how they are loaded."""

    path: str = Field(
        "", description='prepared dataset folder (`kiln data prepare`); "" = build the source '
        "into the cache on first use"
    )
    source: Literal["stdlib", "stdlib_tests", "stdlib_docstrings", "folder"] = Field(
        "stdlib", description="text to build from: this machine's Python stdlib .py files (or "
        "only its test suites, or only its docstrings), or a folder of .txt/.jsonl(.gz/.zst)/"
        ".parquet files (source_path)"
    )
    source_path: str = Field("", description='folder of .txt, .jsonl ({"text": ...}), '
                             ".jsonl.gz/.zst or .parquet files")
    include_tests: bool = Field(False, description="stdlib source: also read its test suites")
    max_bytes: int = Field(
        16_000_000, ge=1, description="cap on source text (UTF-8 bytes); whole documents only"
    )
    num_epochs: int = Field(
        4, ge=1, description="shuffled document orders written; later data epochs reuse them"
    )
    eval_fraction: float = Field(
        0.02, ge=0, lt=1, description="share of documents held out for evaluation"
    )
    cache_dir: str = Field("", description='cache root; "" = $KILN_CACHE or ~/.cache/kiln')
    num_workers: int = Field(0, ge=0, description="loader worker processes (0 = in the trainer)")
    pin_memory: bool = Field(
        True, description="batches in page-locked memory when CUDA is available (asynchronous "
        "host-to-GPU copies; ignored on CPU)",
    )
    prefetch: int = Field(2, ge=1, description="micro-batches each worker loads ahead")


@register("dataset", "packed_documents")
class PackedDocuments(DatasetContract):
    """Documents packed into seq_len windows; default: this machine's Python stdlib, cached."""

    Config = PackedDocumentsConfig

    def __init__(self, cfg: PackedDocumentsConfig, *, tokenizer: Tokenizer, seq_len: int,
                 seed: int = 0, **context: Any) -> None:
        self.cfg, self.tokenizer, self.seq_len, self.seed = cfg, tokenizer, seq_len, seed
        self._folder: Path | None = Path(cfg.path).expanduser() if cfg.path else None
        self._layout: PackedLayout | None = None
        self._corpus = None

    def _source(self) -> Any:
        if self._corpus is None:
            c = self.cfg
            self._corpus = open_corpus(c.source, c.source_path, c.max_bytes, c.include_tests)
        return self._corpus

    def cache_key(self) -> str:
        """Hash of everything that changes the folder's bytes (not seq_len: any seq_len reads
        the same folder)."""
        c = self.cfg
        parts = [self._source().description, self.tokenizer.fingerprint(), c.max_bytes,
                 self.seed, c.num_epochs, c.eval_fraction, "bytes"]  # layouts with byte counts
        if self.seed != SPLIT_SEED:  # the held-out draw left the seed: other entries than before
            parts.append(["split_seed", SPLIT_SEED])
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    @property
    def folder(self) -> Path:
        """The dataset folder: ``path``, or the cache entry for this config."""
        if self._folder is None:
            name = f"{self.cfg.source}-{self.cache_key()}"
            self._folder = cache_root(self.cfg.cache_dir) / "packed" / name
        return self._folder

    def prepare(self, *, create: bool = False) -> Path:
        """Make sure the folder exists and is valid and return it. A cache entry is built when
        missing; an explicit ``path`` only with ``create`` (`kiln data prepare`), so a typo in
        a recipe fails instead of quietly building a new dataset."""
        folder = self.folder
        if not folder.exists() and self.cfg.path and not create:
            raise DataError(
                f"data.path = {self.cfg.path!r}: no dataset folder there; build it from your "
                f"text with `kiln data prepare RECIPE --input FILE_OR_FOLDER... --out "
                f"{self.cfg.path}` (RECIPE: this recipe, for its tokenizer), or fix data.path "
                "(\"\" builds data.source into the cache)")
        if not folder.exists() and (create or not self.cfg.path):
            with file_lock(folder.parent / f".{folder.name}.lock"):
                if not folder.exists():
                    self.build(folder)
        self._layout = open_layout(folder, self.tokenizer)
        return folder

    def build(self, folder: Path) -> Path:
        """Tokenize the source into a new layout folder (the slow part: about a second per
        few MB with the byte tokenizer)."""
        corpus = self._source()
        return write_layout(
            folder, corpus.documents(), self.tokenizer, seq_len=self.seq_len,
            num_epochs=self.cfg.num_epochs, seed=self.seed, eval_fraction=self.cfg.eval_fraction,
            source=corpus.description, extra={"max_bytes": self.cfg.max_bytes},
            split_seed=SPLIT_SEED,
        )

    @property
    def layout(self) -> PackedLayout:
        if self._layout is None:
            self.prepare()
        assert self._layout is not None
        return self._layout

    @property
    def meta(self) -> dict[str, Any]:
        """The folder's metadata.json (counts, splits, source, tokenizer)."""
        return self.layout.meta

    def fingerprints(self) -> dict[str, str]:
        """The data a run's cursor points into (``packed_layout.fingerprint``), saved with
        every checkpoint: a resume on other data is refused."""
        return {"data": layout_fingerprint(self.meta)}

    def eval_fingerprints(self) -> dict[str, str]:
        """The held-out documents (``packed_layout.eval_fingerprint``): the same for every
        ``training.seed``."""
        return {"data": layout_eval_fingerprint(self.meta)}

    @property
    def tokens_per_epoch(self) -> int:
        """Tokens in one train data epoch (BOS/EOS included)."""
        return int(self.meta["splits"]["train"]["tokens"])

    def tokens_per_byte(self, split: str = "eval") -> float | None:
        """Tokens (BOS/EOS included) per UTF-8 byte of text in ``split``, for bits per byte:
        ``bpb = loss * tokens_per_byte / ln 2``; None for layouts built without byte counts."""
        info = self.meta["splits"][split]
        return info["tokens"] / info["bytes"] if info.get("bytes") else None

    @property
    def windows_per_epoch(self) -> int:
        """seq_len windows per train data epoch."""
        return (self.tokens_per_epoch - 1) // self.seq_len

    def rows(self, split: str) -> Windows:
        """Random access to ``split``'s seq_len windows by (data epoch, first window, count):
        how a ``mixture`` reads this dataset as one of its sources."""
        return Windows(self.layout, split, self.seq_len)

    def loader(self, split: str, *, micro_batch: int, global_batch: int, rank: int = 0,
               world_size: int = 1) -> Loader:
        """Rank ``rank``'s micro-batches of ``split`` ("train" or "eval"); see ``Loader``."""
        c = self.cfg
        return Loader(self.layout, split, seq_len=self.seq_len, micro_batch=micro_batch,
                      global_batch=global_batch, rank=rank, world_size=world_size,
                      num_workers=c.num_workers, pin_memory=c.pin_memory, prefetch=c.prefetch,
                      prepared=bool(c.path))

"""Where ``balanced_shards`` finds its ``.npy`` token shards: a local folder or a Hub dataset.

Layout, in both places: ``<root>/<domain>/*.npy`` (``root`` = the folder, or ``prefix`` inside
the Hub repo, e.g. ``data/code/shard_00012.npy``). A shard is either

- a 2-D integer array ``(rows, row_len)``: one training row per line, ``row_len >= seq_len + 1``
  (longer rows are cut to their first ``seq_len + 1`` tokens), or
- a 1-D integer array: a token stream read as windows ``[w*L, w*L + L + 1)`` like
  ``packed_documents``, ``(len - 1) // L`` of them.

uint16 / int32 / uint32 / int64 tokens are read through a memory map and returned as int64.
Listing is repeated whenever a stream moves to its next shard, so shards uploaded (or copied)
while training are picked up. The Hub is reached through ``huggingface_hub``: ``list_repo_tree``
online; offline (``local_files_only`` or ``HF_HUB_OFFLINE=1``) the cached snapshot is listed
instead, and ``hf_hub_download`` serves files from (and fills) the usual Hub cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kiln.components.errors import DataError

_INT_DTYPES = (np.uint16, np.int16, np.int32, np.uint32, np.int64, np.uint8)


SHARDS_JSON = "shards.json"  # what `kiln data prepare --domain` records about a domain
_SHARDS_KEYS = ("shards", "total_tokens", "num_docs", "token_dtype", "vocab_size", "tokenizer",
                "tokenizer_source")


def seeded_rng(seed: int, *keys: str | int) -> np.random.Generator:
    """A generator fixed by the seed and names (crc32: Python's hash() is salted per process)."""
    ints = [k if isinstance(k, int) else zlib.crc32(k.encode()) for k in keys]
    return np.random.default_rng([seed, *ints])


def read_shards_json(domain: Path) -> dict:
    """A domain folder's shards.json, checked: one DataError naming the file when it is
    unreadable, not JSON (or not UTF-8) or lacks a key."""
    path = domain / SHARDS_JSON
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        meta = exc
    missing = [k for k in _SHARDS_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        why = f"unreadable ({meta})" if isinstance(meta, Exception) else \
            f"lacks {', '.join(missing)}"
        raise DataError(f"{path}: {why}; delete the domain folder and rerun "
                        "`kiln data prepare --domain`")
    return meta


class Shard:
    """One opened shard: ``rows`` samples of ``seq_len + 1`` tokens each."""

    def __init__(self, path: Path, seq_len: int, name: str, vocab: int = 0) -> None:
        try:
            arr = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as exc:
            raise DataError(f"{name}: not a readable .npy array ({exc}); re-create the shard"
                            ) from exc
        if arr.dtype.type not in _INT_DTYPES or arr.ndim not in (1, 2):
            raise DataError(
                f"{name}: a shard must be a 1-D token stream or a 2-D (rows, tokens) array of "
                f"integers (uint16, int32, ...), got {arr.ndim}-D {arr.dtype}"
            )
        self.array, self.seq_len, self.name = arr, seq_len, name
        self.vocab = vocab  # > 0: every id read must be in [0, vocab) (the tokenizer's ids)
        if arr.ndim == 2:
            if arr.shape[1] < seq_len + 1:
                raise DataError(
                    f"{name}: rows of {arr.shape[1]} tokens, but seq_len {seq_len} needs "
                    f"{seq_len + 1} (inputs + the shifted label); lower training.seq_len or "
                    "write longer rows"
                )
            self.rows = int(arr.shape[0])
        else:
            self.rows = max(0, (len(arr) - 1) // seq_len)

    def read(self, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` as int64 ``(len(index), seq_len + 1)``."""
        n = self.seq_len + 1
        if self.array.ndim == 2:
            order = np.argsort(index)  # memory-map reads in file order
            out = np.empty((len(index), n), dtype=np.int64)
            out[order] = self.array[index[order], :n]
        else:
            pos = index[:, None] * self.seq_len + np.arange(n)
            out = np.asarray(self.array[pos], dtype=np.int64)
        if self.vocab and out.size and (out.max() >= self.vocab or out.min() < 0):
            bad = out[(out >= self.vocab) | (out < 0)][0]
            raise DataError(
                f"{self.name}: token id {bad} is outside the vocabulary of the recipe's "
                f"tokenizer ({self.vocab} ids); the shard is damaged or was written with another "
                "tokenizer: re-create it (`kiln data prepare --domain`) or set [tokenizer] to "
                "the one it was written with"
            )
        return out


class FolderSource:
    """Shards in ``<root>/<domain>/*.npy`` on a local (or network) file system."""

    def __init__(self, root: str) -> None:
        self.root = Path(root).expanduser()
        self.where = str(self.root)

    def list(self, domain: str) -> list[str]:
        folder = self.root / domain
        return sorted(f"{domain}/{p.name}" for p in folder.glob("*.npy")) if folder.is_dir() else []

    def fetch(self, name: str) -> Path:
        return self.root / name


class HubSource:
    """Shards in ``<prefix>/<domain>/*.npy`` of a Hugging Face Hub dataset repository."""

    def __init__(self, repo_id: str, prefix: str, revision: str, cache_dir: str,
                 local_files_only: bool) -> None:
        import huggingface_hub  # imported here: only Hub recipes pay for it

        self.hub = huggingface_hub
        self.repo_id, self.revision = repo_id, revision or None
        self.prefix = prefix.strip("/")
        self.cache_dir = cache_dir or None
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
        self.offline = local_files_only or offline
        self.where = f"hf://datasets/{repo_id}/{self.prefix}"

    def _path(self, domain: str) -> str:
        return f"{self.prefix}/{domain}" if self.prefix else domain

    def _strip(self, path: str) -> str:
        return path[len(self.prefix) + 1:] if self.prefix else path

    def list(self, domain: str) -> list[str]:
        if self.offline:
            return self._list_cached(domain)
        with self._reaching(f"list {self._path(domain)}/"):
            entries = list(self.hub.HfApi().list_repo_tree(
                self.repo_id, path_in_repo=self._path(domain), repo_type="dataset",
                revision=self.revision, recursive=False,
            ))
        return sorted(self._strip(e.path) for e in entries if e.path.endswith(".npy"))

    @contextlib.contextmanager
    def _reaching(self, what: str) -> Iterator[None]:
        """A Hub call's failure as one DataError: the repository, what was asked and why (a
        missing repository, revision or file, refused access, no network: the Hub library and
        its HTTP client raise each as its own type, so any is caught)."""
        try:
            yield
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise DataError(
                f"{self.where}: cannot {what} ({type(exc).__name__}: {first[:200]}); check "
                "data.repo_id and data.revision and that the Hub can be reached, or train "
                "from a local copy (data.path, or data.local_files_only = true once it is "
                "cached)") from None

    def _list_cached(self, domain: str) -> list[str]:
        try:
            snapshot = self.hub.snapshot_download(
                self.repo_id, repo_type="dataset", revision=self.revision,
                cache_dir=self.cache_dir, local_files_only=True,
                allow_patterns=[f"{self._path(domain)}/*.npy"],
            )
        except Exception as exc:  # the Hub library raises several "not cached" types
            raise DataError(
                f"{self.where}: offline and no cached snapshot of {self.repo_id!r} "
                f"({type(exc).__name__}); download it once online (or unset local_files_only "
                "/ HF_HUB_OFFLINE)"
            ) from exc
        folder = Path(snapshot) / self._path(domain)
        return sorted(f"{domain}/{p.name}" for p in folder.glob("*.npy"))

    def fetch(self, name: str) -> Path:
        filename = f"{self.prefix}/{name}" if self.prefix else name
        with self._reaching(f"fetch {filename}"):
            return Path(self.hub.hf_hub_download(
                self.repo_id, filename, repo_type="dataset", revision=self.revision,
                cache_dir=self.cache_dir, local_files_only=self.offline,
            ))

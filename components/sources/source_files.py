"""One input file of a corpus: its kind (by suffix) and, for Hub dataset files, where to fetch
it from (``huggingface_hub`` downloads into the Hub cache; offline the cache is read)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kiln.components.errors import DataError


def hub_offline() -> bool:
    """HF_HUB_OFFLINE is set: read the Hub cache, never download."""
    from huggingface_hub import constants

    env = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    return env or bool(constants.HF_HUB_OFFLINE)


KINDS = {".txt": "txt", ".jsonl": "jsonl", ".jsonl.gz": "jsonl.gz", ".jsonl.zst": "jsonl.zst",
         ".parquet": "parquet", ".arrow": "arrow"}


@dataclass(frozen=True)
class SourceFile:
    """One input file. Hub files carry their repo coordinates and are fetched when read."""

    name: str  # as errors and manifests show it: a local path or hf://datasets/...
    kind: str  # a value of KINDS
    size: int
    local: str = ""  # local path ("" for a Hub file not fetched yet)
    repo: str = ""
    filename: str = ""
    revision: str = ""
    cache_dir: str = ""

    def path(self) -> Path:
        if self.local:
            return Path(self.local)
        return fetch(self)


def kind_of(path: str) -> str | None:
    lower = path.lower()
    for suffix in sorted(KINDS, key=len, reverse=True):
        if lower.endswith(suffix):
            return KINDS[suffix]
    return None


def fetch(src: SourceFile) -> Path:
    """The local copy of a Hub file (downloaded into the Hub cache when online)."""
    import huggingface_hub as hub

    try:
        return Path(hub.hf_hub_download(src.repo, src.filename, repo_type="dataset",
                                        revision=src.revision, cache_dir=src.cache_dir or None))
    except Exception as exc:  # the Hub library raises several types for "not there"
        where = "not in the local Hub cache" if hub_offline() else "could not be downloaded"
        raise DataError(f"{src.name}: {where} ({type(exc).__name__}); download the dataset "
                        "once online") from None

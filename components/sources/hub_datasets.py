"""Hub datasets as text inputs: ``hf://datasets/owner/name[@revision]``, read file by file.

The repository's data files (parquet, JSONL, ...) are listed (online through the Hub API;
offline, ``HF_HUB_OFFLINE=1``, from the cached snapshot) and each is fetched into the Hub cache
with ``huggingface_hub`` just before it is read, so a corpus streams through one file at a time
and reruns read the cache. No ``datasets`` package is needed.

Which files belong to a split follows the Hub's own file-name convention: a file is in split
``S`` when a folder of its path is named ``S`` or its name starts with ``S`` followed by ``-``,
``_`` or ``.`` (``data/train-00000-of-00004.parquet``, ``train/0.jsonl``); with no split names
in the repository at all, every file is ``train``. ``config`` keeps the files under a folder of
that name (the parquet-converted layout ``<config>/<split>/...``).
"""

from __future__ import annotations

import re
from pathlib import Path

from kiln.components.errors import DataError
from kiln.components.sources.source_files import SourceFile, hub_offline, kind_of

DATASET_PREFIX = "hf://datasets/"
_SPLIT_WORDS = ("train", "validation", "valid", "dev", "test", "eval")


def parse(spec: str) -> tuple[str, str | None]:
    """``hf://datasets/owner/name[@revision]`` -> (repo id, revision or None)."""
    repo, _, revision = spec[len(DATASET_PREFIX):].partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise DataError(f"input {spec!r}: write hf://datasets/owner/name[@revision]")
    return repo, revision or None


def in_split(path: str, split: str) -> bool:
    parts = path.split("/")
    return split in parts[:-1] or re.match(rf"{re.escape(split)}([-_.]|$)", parts[-1]) is not None


def select(paths: list[str], split: str, config: str) -> list[str]:
    """The data files of ``config`` / ``split`` among a repository's file paths."""
    files = [p for p in paths if kind_of(p) and not p.startswith(".")]
    if config:
        files = [p for p in files if config in p.split("/")[:-1]]
    if any(in_split(p, w) for p in files for w in _SPLIT_WORDS):
        files = [p for p in files if in_split(p, split)]
    elif split != "train":
        files = []
    return sorted(files)


def _listing(repo: str, revision: str | None, cache_dir: str) -> tuple[str, dict[str, int]]:
    """(commit, {path: size}) of the repository: the cached snapshot when offline."""
    import huggingface_hub as hub

    if hub_offline():
        try:
            snap = Path(hub.snapshot_download(repo, repo_type="dataset", revision=revision,
                                              cache_dir=cache_dir or None,
                                              local_files_only=True))
        except Exception as exc:  # the Hub library raises several "not cached" types
            raise DataError(
                f"{DATASET_PREFIX}{repo}: not in the local Hub cache and HF_HUB_OFFLINE is set "
                f"({type(exc).__name__}); download it once online (`hf download {repo} "
                "--repo-type dataset`) or give local files"
            ) from None
        files = {p.relative_to(snap).as_posix(): p.stat().st_size
                 for p in snap.rglob("*") if p.is_file()}
        return snap.name, files
    api = hub.HfApi()
    info = api.dataset_info(repo, revision=revision)
    entries = api.list_repo_tree(repo, repo_type="dataset", revision=info.sha, recursive=True)
    return info.sha, {e.path: int(getattr(e, "size", 0) or 0) for e in entries
                      if hasattr(e, "size")}


def list_hub_files(spec: str, *, split: str, config: str, cache_dir: str = "") -> list[SourceFile]:
    repo, revision = parse(spec)
    commit, files = _listing(repo, revision, cache_dir)
    chosen = select(list(files), split, config)
    if not chosen:
        what = f"config {config!r}, " if config else ""
        raise DataError(f"{spec}: no data files for {what}split {split!r} among "
                        f"{len(files)} files; check --split / --config")
    return [SourceFile(f"{DATASET_PREFIX}{repo}@{commit}/{p}", kind_of(p) or "", files[p],
                       repo=repo, filename=p, revision=commit, cache_dir=cache_dir)
            for p in chosen]



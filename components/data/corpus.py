"""Text sources for the packed-document builder: the Python standard library, or a folder.

Each source yields documents (one per file, or one per JSONL line) in a fixed order and has a
``description`` that changes whenever its content selection changes: it goes into the data
cache key, so editing the folder (or a different Python) builds a new dataset instead of
silently reusing a stale one.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kiln.components.errors import DataError

# Folders never read from the stdlib: installed packages and bytecode caches.
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
# Folders holding the stdlib's own test suites (large, repetitive, some odd encodings).
_TEST_DIRS = {"test", "tests", "idle_test"}


@dataclass(frozen=True)
class Corpus:
    """An ordered list of files read as documents, capped at ``max_bytes`` of text."""

    kind: str  # "stdlib" | "folder"
    root: Path
    files: tuple[Path, ...]  # every candidate file, in reading order
    max_bytes: int  # documents are taken in order while they fit this many UTF-8 bytes

    @property
    def description(self) -> str:
        """Human-readable origin plus a digest of the selection (path and size of each file)."""
        h = hashlib.sha256()
        for f in self.files:
            st = f.stat()
            h.update(f"{f.relative_to(self.root).as_posix()}\0{st.st_size}\0".encode())
        python = f"python {sys.version.split()[0]}:" if self.kind == "stdlib" else ""
        return f"{self.kind}:{python}{self.root}:{len(self.files)} files:{h.hexdigest()[:16]}"

    def documents(self) -> Iterator[str]:
        """Documents in order while they fit ``max_bytes``; one too big for what is left is
        skipped (not cut), so a small cap still gets whole documents."""
        left = self.max_bytes
        for text in self._all_documents():
            size = len(text.encode("utf-8"))
            if size <= left:
                left -= size
                yield text
            if left == 0:
                return

    def _all_documents(self) -> Iterator[str]:
        """Each document's text: a whole file, or the ``text`` field of each JSONL line."""
        for f in self.files:
            raw = f.read_bytes().decode("utf-8", errors="replace")
            if f.suffix != ".jsonl":
                if raw:
                    yield raw
                continue
            for lineno, line in enumerate(raw.splitlines(), 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError) as exc:
                    raise DataError(
                        f"{f}:{lineno}: not a JSON object with a \"text\" field ({exc}); each "
                        "JSONL line must look like {\"text\": \"...\"}; fix or remove the line"
                    ) from exc
                if not isinstance(text, str):
                    raise DataError(f"{f}:{lineno}: \"text\" must be a string, got {text!r:.40}")
                if text:
                    yield text


def stdlib_corpus(max_bytes: int, include_tests: bool = False) -> Corpus:
    """The standard library's ``.py`` files on this machine, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(
            f"the Python standard library folder {root} does not exist on this machine; "
            "use a folder of .txt/.jsonl files instead (source = \"folder\")"
        )
    skip = _SKIP_DIRS if include_tests else _SKIP_DIRS | _TEST_DIRS
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        found += [Path(folder) / n for n in names if n.endswith(".py")]
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    return Corpus("stdlib", root, tuple(found), max_bytes)


def folder_corpus(path: str | Path, max_bytes: int) -> Corpus:
    """Every ``.txt`` and ``.jsonl`` file under ``path`` (recursively), sorted by relative path."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise DataError(
            f"source folder {path!r} does not exist; give a folder of .txt or .jsonl files "
            "(one document per .txt file or per JSONL line with a \"text\" field)"
        )
    found = sorted(
        (p for p in root.rglob("*") if p.suffix in (".txt", ".jsonl") and p.is_file()),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not found:
        raise DataError(f"source folder {root} holds no .txt or .jsonl files; add some")
    return Corpus("folder", root, tuple(found), max_bytes)


def open_corpus(source: str, source_path: str, max_bytes: int, include_tests: bool) -> Corpus:
    """The corpus a dataset config names."""
    if source == "stdlib":
        return stdlib_corpus(max_bytes, include_tests)
    if source == "folder":
        if not source_path:
            raise DataError("source = \"folder\" needs source_path: a folder of .txt/.jsonl files")
        return folder_corpus(source_path, max_bytes)
    raise DataError(f"unknown data source {source!r}; valid: stdlib, folder")

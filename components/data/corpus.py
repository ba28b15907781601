"""Text sources for the packed-document cache builder: the Python standard library (its code,
its test suites only, or its docstrings only), or a folder.

Each source yields documents (one per text file, one per JSONL line or parquet / Arrow row; see
``text_sources``) in a fixed order and has a ``description`` that changes whenever its content
selection changes: it goes into the data cache key, so editing the folder (or a different
Python) builds a new dataset instead of silently reusing a stale one.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kiln.components.errors import DataError
from kiln.components.sources.text_sources import (
    KINDS,
    SourceFile,
    expand_inputs,
    read_documents,
    stdlib_files,
)


@dataclass(frozen=True)
class Corpus:
    """An ordered list of files read as documents, capped at ``max_bytes`` of text."""

    kind: str  # "stdlib" | "stdlib_tests" | "stdlib_docstrings" | "folder"
    root: Path
    sources: tuple[SourceFile, ...]  # every candidate file, in reading order
    max_bytes: int  # documents are taken in order while they fit this many UTF-8 bytes
    text_field: str = "text"
    digest: str = ""  # of the selection (path, size and mtime of each file); computed when empty

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(Path(s.local) for s in self.sources)

    @property
    def description(self) -> str:
        """Human-readable origin plus a digest of the selection: path, size and modification
        time of each file, so an edit that keeps a file's size still builds a new entry."""
        digest = self.digest or _digest(self.root, self.files, mtime=True)
        python = f"python {sys.version.split()[0]}:" if self.kind != "folder" else ""
        return f"{self.kind}:{python}{self.root}:{len(self.sources)} files:{digest}"

    def documents(self) -> Iterator[str]:
        """Documents in order while they fit ``max_bytes``; one too big for what is left is
        skipped (not cut), so a small cap still gets whole documents."""
        left = self.max_bytes
        for src in self.sources:
            for _, _, text in read_documents(src, text_field=self.text_field):
                if self.kind == "stdlib_docstrings" and not (text := docstrings(text)):
                    continue
                size = len(text.encode("utf-8"))
                if size <= left:
                    left -= size
                    yield text
                if left == 0:
                    return


def _digest(root: Path, files: tuple[Path, ...], mtime: bool = False) -> str:
    """Of each file's relative path and size, and its modification time with ``mtime`` (a
    folder: edits; the standard library's files do not change, and its digest stays)."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(root).as_posix()}\0{st.st_size}\0".encode())
        if mtime:
            h.update(f"{st.st_mtime_ns}\0".encode())
    return h.hexdigest()[:16]


def stdlib_corpus(max_bytes: int, include_tests: bool = False, kind: str = "stdlib") -> Corpus:
    """The standard library's ``.py`` files on this machine, sorted by relative path; ``kind``
    "stdlib_tests": its test suites only; "stdlib_docstrings": every file's docstrings."""
    sources, digest = _stdlib_selection(kind, include_tests or kind == "stdlib_tests")
    return Corpus(kind, _stdlib_root(), sources, max_bytes, digest=digest)


@functools.cache
def _stdlib_selection(kind: str, include_tests: bool) -> tuple[tuple[SourceFile, ...], str]:
    """Once per process: the standard library does not change while a process runs, and
    walking and stat-ing its ~1,000 files cost every run's start ~40 ms (tests start hundreds)."""
    files = stdlib_files(include_tests)
    if kind == "stdlib_tests":
        code = set(stdlib_files(False))
        files = [f for f in files if f not in code]
    root = _stdlib_root()
    paths = tuple(files)
    return tuple(SourceFile(str(p), "txt", 0, local=str(p)) for p in paths), _digest(root, paths)


def docstrings(source: str) -> str:
    """The module's, classes' and functions' docstrings of Python ``source``, in order, one
    paragraph each ("" for a file that does not parse or has none): English prose from code."""
    try:
        with warnings.catch_warnings():  # old escapes in stdlib strings warn when parsed
            warnings.simplefilter("ignore")
            tree = ast.parse(source)
    except (SyntaxError, ValueError):  # stdlib test data holds deliberately broken files
        return ""
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(
        n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef))]
    found = [ast.get_docstring(n) for n in nodes]
    return "\n\n".join(d for d in found if d)


def _stdlib_root() -> Path:
    import sysconfig

    return Path(sysconfig.get_paths()["stdlib"])


def folder_corpus(path: str | Path, max_bytes: int, text_field: str = "text") -> Corpus:
    """Every supported file under ``path`` (recursively; see ``text_sources``), sorted by
    relative path."""
    root = Path(path).expanduser().resolve()
    if not root.is_dir():
        raise DataError(
            f"source folder {path!r} does not exist; give a folder of {', '.join(KINDS)} files "
            "(one document per .txt file, per JSONL line or per parquet row)"
        )
    try:
        sources = expand_inputs([str(root)])
    except DataError:
        raise DataError(f"source folder {root} holds no {', '.join(KINDS)} files; add some") \
            from None
    return Corpus("folder", root, tuple(sources), max_bytes, text_field)


def open_corpus(source: str, source_path: str, max_bytes: int, include_tests: bool) -> Corpus:
    """The corpus a dataset config names."""
    if source in ("stdlib", "stdlib_tests", "stdlib_docstrings"):
        return stdlib_corpus(max_bytes, include_tests, kind=source)
    if source == "folder":
        if not source_path:
            raise DataError("source = \"folder\" needs source_path: a folder of .txt/.jsonl/"
                            ".parquet files")
        return folder_corpus(source_path, max_bytes)
    raise DataError(f"unknown data source {source!r}; valid: stdlib, stdlib_tests, "
                    "stdlib_docstrings, folder")

"""Documents from real corpora: which files an input names, and reading their documents.

An input is a file, a folder (every supported file under it, recursively), a glob, a Hugging
Face dataset saved to disk (``save_to_disk``: its Arrow files, ``split`` of a DatasetDict), a
Hub dataset ``hf://datasets/owner/name[@revision]`` (see ``hub_datasets``), or ``stdlib`` (this
machine's Python standard library). Documents:

- ``.txt`` (and the stdlib's ``.py``): the whole file is one document;
- ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` (the ``zstandard`` package): one per line, the
  ``text_field`` of each JSON object;
- ``.parquet`` (pyarrow) and ``.arrow`` (Arrow IPC, as ``datasets`` writes): one per row, the
  ``text_field`` column.

Every reader starts at a document index (plain JSONL also at a byte offset, so it resumes
without re-reading) and yields ``(index after, byte offset after, text)``; errors name the file
and the line or row. Invalid UTF-8 is counted and the document skipped (``on_invalid_utf8 =
"skip"``) or is an error (``"fail"``).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.components.errors import DataError
from kiln.components.sources.hub_datasets import DATASET_PREFIX, list_hub_files
from kiln.components.sources.source_files import KINDS, SourceFile, kind_of

__all__ = ["KINDS", "ReadStats", "SourceFile", "expand_inputs", "kind_of", "read_documents",
           "stdlib_files"]

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}
_BATCH_ROWS = 1024  # rows per Arrow batch read: bounded memory whatever the row-group size


@dataclass
class ReadStats:
    """What reading skipped, for the summary line (errors stop reading instead)."""

    invalid_utf8: int = 0
    empty: int = 0
    where: list[str] = field(default_factory=list)  # the first few skipped places

    def skip(self, what: str, place: str) -> None:
        setattr(self, what, getattr(self, what) + 1)
        if len(self.where) < 5:
            self.where.append(place)


def _local(path: Path, kind: str) -> SourceFile:
    return SourceFile(str(path), kind, path.stat().st_size, local=str(path))


def stdlib_files(include_tests: bool = False) -> list[Path]:
    """The standard library's ``.py`` files on this machine, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise DataError(f"the Python standard library folder {root} does not exist on this "
                        "machine; use a folder of .txt/.jsonl/.parquet files instead")
    skip = _SKIP_DIRS if include_tests else _SKIP_DIRS | _TEST_DIRS
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in skip]
        found += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _saved_dataset(folder: Path, split: str) -> list[SourceFile] | None:
    """The Arrow files of a ``datasets`` save_to_disk folder, or None if it is not one."""
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if split not in splits:
            raise DataError(f"{folder}: a saved DatasetDict without split {split!r}; its "
                            f"splits: {', '.join(splits)} (use --split)")
        folder = folder / split
    if not (folder / "state.json").is_file() or not (folder / "dataset_info.json").is_file():
        return None
    state = json.loads((folder / "state.json").read_text())
    names = [f["filename"] for f in state.get("_data_files", [])]
    return [_local(folder / n, "arrow") for n in names]


def _folder(folder: Path, split: str) -> list[SourceFile]:
    saved = _saved_dataset(folder, split)
    if saved is not None:
        return saved
    found = [p for p in folder.rglob("*") if kind_of(p.name) and p.is_file()]
    found.sort(key=lambda p: p.relative_to(folder).as_posix())
    return [_local(p, kind_of(p.name)) for p in found]  # type: ignore[arg-type]


def expand_inputs(inputs: list[str], *, split: str = "train", config: str = "",
                  cache_dir: str = "", include_tests: bool = False) -> list[SourceFile]:
    """The files the inputs name, in order (each input's files sorted), without duplicates."""
    files: list[SourceFile] = []
    for spec in inputs:
        if spec == "stdlib":
            found = [_local(p, "txt") for p in stdlib_files(include_tests)]
        elif spec.startswith(DATASET_PREFIX):
            found = list_hub_files(spec, split=split, config=config, cache_dir=cache_dir)
        elif any(c in spec for c in "*?["):
            paths = sorted(Path(p) for p in glob.glob(os.path.expanduser(spec), recursive=True))
            found = [f for p in paths for f in (_folder(p, split) if p.is_dir() else
                     [_local(p, kind_of(p.name))] if kind_of(p.name) else [])]
        else:
            path = Path(spec).expanduser()
            if path.is_dir():
                found = _folder(path, split)
            elif path.is_file():
                kind = kind_of(path.name)
                if kind is None:
                    raise DataError(f"input {spec}: unsupported file type; kiln reads "
                                    f"{', '.join(KINDS)} files, folders and saved datasets")
                found = [_local(path, kind)]
            else:
                raise DataError(f"input {spec}: no such file or folder")
        if not found:
            raise DataError(f"input {spec}: no {', '.join(KINDS)} files there")
        files += found
    seen: set[str] = set()
    return [f for f in files if not (f.name in seen or seen.add(f.name))]  # type: ignore[func-returns-value]


# ------------------------------------------------------------------------------ reading
def _decode(data: bytes, place: str, policy: str, stats: ReadStats) -> str | None:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        if policy == "fail":
            raise DataError(f"{place}: invalid UTF-8 ({exc.reason} at byte {exc.start}); fix "
                            "the data or use --on-invalid-utf8 skip") from None
        stats.skip("invalid_utf8", place)
        return None


def _field(value: Any, place: str, text_field: str, policy: str, stats: ReadStats) -> str | None:
    if isinstance(value, bytes):
        return _decode(value, place, policy, stats)
    if not isinstance(value, str):
        raise DataError(f"{place}: field {text_field!r} must be a string, got "
                        f"{type(value).__name__} ({value!r:.40}); fix the row or use --text-field")
    return value


def _json_lines(stream: Any, src: SourceFile, start: int, offset: int, text_field: str,
                policy: str, stats: ReadStats, seekable: bool) -> Iterator[tuple[int, int, str]]:
    index = 0
    if seekable and offset:
        stream.seek(offset)
        index = start
    for raw in stream:
        index += 1
        offset += len(raw)
        if index <= start or not raw.strip():
            continue
        place = f"{src.name}:{index}"
        try:
            obj = json.loads(raw)
        except UnicodeDecodeError:
            if _decode(raw, place, policy, stats) is None:
                continue
            raise
        except ValueError as exc:
            raise DataError(f"{place}: not a JSON object ({exc}); each line must look like "
                            f"{{\"{text_field}\": \"...\"}}; fix or remove the line") from None
        if not isinstance(obj, dict) or text_field not in obj:
            keys = ", ".join(obj) if isinstance(obj, dict) else type(obj).__name__
            raise DataError(f"{place}: no {text_field!r} field (found: {keys}); set "
                            "--text-field / text_field to the field holding the text")
        text = _field(obj[text_field], place, text_field, policy, stats)
        if text is not None:
            yield index, offset if seekable else 0, text


def _open_compressed(path: Path, kind: str) -> Any:
    if kind == "jsonl.gz":
        return gzip.open(path, "rb")
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{path}: reading .zst needs the zstandard package (pip install "
                        "'kiln[zstd]' or zstandard)") from None
    import io

    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"),
                                                                         closefd=True))


def _arrow_batches(src: SourceFile, path: Path, text_field: str) -> Iterator[Any]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if src.kind == "parquet":
            pf = pq.ParquetFile(path)
            names = pf.schema_arrow.names
            if text_field not in names:
                raise DataError(f"{src.name}: no column {text_field!r} (columns: "
                                f"{', '.join(names)}); set --text-field / text_field")
            yield from pf.iter_batches(batch_size=_BATCH_ROWS, columns=[text_field])
            return
        source = pa.memory_map(str(path))
        try:
            reader: Any = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            reader = (reader.get_batch(i) for i in range(reader.num_record_batches))
            first = None
        else:
            first = reader.schema
        for batch in reader:
            names = (first or batch.schema).names
            if text_field not in names:
                raise DataError(f"{src.name}: no column {text_field!r} (columns: "
                                f"{', '.join(names)}); set --text-field / text_field")
            yield batch.select([text_field])
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{src.name}: not a readable {src.kind} file ({exc})") from None


def _rows(src: SourceFile, path: Path, start: int, text_field: str, policy: str,
          stats: ReadStats) -> Iterator[tuple[int, int, str]]:
    index = 0
    for batch in _arrow_batches(src, path, text_field):
        n = batch.num_rows
        if index + n <= start:  # whole batch already read: skip without converting it
            index += n
            continue
        values = batch.column(0).to_pylist()
        for i in range(max(start - index, 0), n):
            place = f"{src.name}: row {index + i}"
            if values[i] is None:
                raise DataError(f"{place}: {text_field!r} is null; drop the row or fill it")
            text = _field(values[i], place, text_field, policy, stats)
            if text is not None:
                yield index + i + 1, 0, text
        index += n


def read_documents(src: SourceFile, *, text_field: str = "text", start: int = 0,
                   offset: int = 0, on_invalid_utf8: str = "skip",
                   stats: ReadStats | None = None) -> Iterator[tuple[int, int, str]]:
    """``(index after, offset after, text)`` of each document of ``src`` from ``start``."""
    stats = stats if stats is not None else ReadStats()
    path = src.path()
    try:
        if src.kind == "txt":
            data = path.read_bytes()
            if not data.strip():
                stats.skip("empty", src.name)
            elif start == 0:
                text = _decode(data, src.name, on_invalid_utf8, stats)
                if text is not None:
                    yield 1, 0, text
        elif src.kind == "jsonl":
            with open(path, "rb") as f:
                yield from _json_lines(f, src, start, offset, text_field, on_invalid_utf8,
                                       stats, seekable=True)
        elif src.kind in ("jsonl.gz", "jsonl.zst"):
            with _open_compressed(path, src.kind) as f:
                yield from _json_lines(f, src, start, 0, text_field, on_invalid_utf8, stats,
                                       seekable=False)
        else:
            yield from _rows(src, path, start, text_field, on_invalid_utf8, stats)
    except FileNotFoundError:
        raise DataError(f"{src.name}: the file disappeared while reading") from None
    except (EOFError, OSError) as exc:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{src.name}: not a readable {src.kind} file ({exc})") from None

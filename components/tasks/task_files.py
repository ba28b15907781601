"""Reading a task's examples: JSONL, JSON or parquet files on disk (what Hugging Face ``datasets``
saves), or one file of a Hub dataset repository ``hf://datasets/owner/name[@revision]/PATH``
fetched into the Hub cache with ``huggingface_hub`` (cache only under ``HF_HUB_OFFLINE=1``).

Rows are plain dicts; ``value(row, "choices.text")`` walks a dotted path (list items by number,
``choices.0``). Every problem names the task, the file and the example index.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.components.errors import DataError
from kiln.components.fields import text, value  # noqa: F401  (task modules use task_files.text)

HUB_PREFIX = "hf://datasets/"
SUFFIXES = (".jsonl", ".json", ".parquet")


def hub_file(spec: str, task: str) -> Path:
    """The local path of ``hf://datasets/owner/name[@revision]/PATH`` (downloaded into the Hub
    cache when online; read from it when ``HF_HUB_OFFLINE=1``)."""
    parts = spec[len(HUB_PREFIX):].split("/", 2)
    if len(parts) < 3 or not all(parts):
        raise DataError(f"task {task!r}: path {spec!r}: write hf://datasets/owner/name"
                        "[@revision]/path/to/file.parquet (one file of the dataset repository)")
    owner, name, filename = parts
    name, _, revision = name.partition("@")
    import huggingface_hub as hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(hub.hf_hub_download(f"{owner}/{name}", filename, repo_type="dataset",
                                        revision=revision or None))
    except LocalEntryNotFoundError:
        raise DataError(f"task {task!r}: {spec} is not in the Hugging Face cache and the Hub "
                        "cannot be reached (HF_HUB_OFFLINE=1 or no network): download it once "
                        "online, or point path at a local copy") from None
    except Exception as exc:  # repository or file not found, refused access, ...
        raise DataError(f"task {task!r}: cannot fetch {spec}: {type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def local_path(path: str, task: str) -> Path:
    if not path:
        raise DataError(f"task {task!r}: no path: set path = \"FILE.jsonl\" (or .json, .parquet, "
                        "hf://datasets/owner/name/FILE) in its [evals.NAME] table")
    if path.startswith(HUB_PREFIX):
        return hub_file(path, task)
    file = Path(path).expanduser()
    if not file.is_file():
        if file.is_dir():
            raise DataError(f"task {task!r}: {file} is a folder: name one file of it")
        where = "" if file.is_absolute() else f" (in the working folder, {Path.cwd()})"
        raise DataError(f"task {task!r}: file {file} not found{where}")
    return file


def read_rows(path: str, task: str) -> tuple[list[dict[str, Any]], str]:
    """(rows, the file's name for messages)."""
    file = local_path(path, task)
    label = path if path.startswith(HUB_PREFIX) else str(file)
    suffix = "".join(s for s in file.suffixes[-1:]).lower()
    if suffix == ".parquet":
        rows = _parquet(file, task, label)
    elif suffix in (".jsonl", ".json"):
        rows = _json(file, task, label)
    else:
        raise DataError(f"task {task!r}: {label}: unknown file type {suffix or '(none)'}; "
                        f"give {', '.join(SUFFIXES)}")
    if not rows:
        raise DataError(f"task {task!r}: {label} holds no examples")
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataError(f"task {task!r}: {label}: {example(i)} is not an object: "
                            f"{row!r:.80}")
    return rows, label


def example(index: int) -> str:
    """An example's name in messages: its index, counted from 0 as the scores' files count, and
    its place in the file, counted from 1 as an editor counts lines ("example 5 (the file's
    6th)")."""
    n = index + 1
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"example {index} (the file's {n}{suffix})"


def _parquet(file: Path, task: str, label: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(file).to_pylist()
    except Exception as exc:  # pyarrow raises its own error types for a damaged file
        raise DataError(f"task {task!r}: {label}: not a readable parquet file "
                        f"({type(exc).__name__}: {exc})") from None


def _json(file: Path, task: str, label: str) -> list[Any]:
    data = file.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(f"task {task!r}: {label}: not UTF-8 text: byte 0x{data[exc.start]:02x} "
                        f"at line {line}; save the file as UTF-8") from None
    stripped = text.lstrip()
    if stripped.startswith("["):  # a JSON array of examples
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"task {task!r}: {label}: invalid JSON at line {exc.lineno}: "
                            f"{exc.msg}") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise DataError(f"task {task!r}: {label}: line {n} (example {len(rows)}) is not "
                            f"JSON: {exc.msg}") from None
    return rows



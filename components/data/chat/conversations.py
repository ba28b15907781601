"""Conversations from files: rows with ``messages``, prompt / completion pairs, or any fields
mapped to either, checked turn by turn.

A row becomes a list of ``{"role", "content"}`` messages. ``fields`` maps the canonical names to
the row's own: ``messages`` (a dotted path to a list of messages), or ``prompt`` / ``completion``
/ ``system`` (a dotted path, or a format string such as ``"{instruction}\\n\\n{input}"`` whose
names are the row's fields: Alpaca's instruction / input / output). Every error names the file
and the row, so a bad example is found without a debugger.
"""

from __future__ import annotations

import json
import string
from collections.abc import Iterator
from typing import Any

from kiln.components.errors import DataError
from kiln.components.fields import value
from kiln.components.sources.source_files import SourceFile
from kiln.components.sources.text_sources import _open_compressed, expand_inputs

ROLES = ("system", "user", "assistant")
Message = dict[str, str]


def read_rows(path: str, *, split: str = "train",
              cache_dir: str = "") -> Iterator[tuple[str, dict]]:
    """``(where, row)`` of every row of the files ``path`` names (a file, a folder, a glob, a
    ``datasets.save_to_disk`` folder or ``hf://datasets/OWNER/NAME``); ``where`` names the file
    and the line or row."""
    for src in expand_inputs([path], split=split, cache_dir=cache_dir):
        if src.kind == "txt":
            raise DataError(f"{src.name}: a .txt file has no conversations; chat data reads "
                            ".jsonl(.gz/.zst), .parquet or .arrow rows")
        yield from _file_rows(src)


def _file_rows(src: SourceFile) -> Iterator[tuple[str, dict]]:
    path = src.path()
    if src.kind.startswith("jsonl"):
        compressed = src.kind != "jsonl"
        with _open_compressed(path, src.kind) if compressed else open(path, "rb") as stream:
            for n, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise DataError(f"{src.name}: line {n} is not JSON ({exc})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{src.name}: line {n} is a {type(row).__name__}, not an "
                                    "object with the conversation's fields")
                yield f"{src.name}: line {n}", row
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path) if src.kind == "parquet" else _arrow_table(path)
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{src.name}: not a readable {src.kind} file ({exc})") from None
    for i, row in enumerate(table.to_pylist()):
        yield f"{src.name}: row {i}", row


def _arrow_table(path) -> Any:
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        return pa.ipc.open_file(source).read_all()


def field_text(row: dict, spec: str, where: str) -> str:
    """A dotted path's text, or a format string over the row's fields."""
    if "{" not in spec:
        got = value(row, spec, where)
        if not isinstance(got, str):
            raise DataError(f"{where}: field {spec!r} must be text, got {type(got).__name__}")
        return got
    # Assembled piece by piece (not str.format): a name may be a dotted path ("{doc.title}")
    out = []
    for literal, name, fmt, _ in string.Formatter().parse(spec):
        out.append(literal)
        if name:
            got = value(row, name, where)
            out.append(format("" if got is None else str(got), fmt or ""))
    return "".join(out)


def to_messages(row: dict, fields: dict[str, str], where: str) -> list[Message]:
    """The row's conversation, checked (``check``)."""
    if "prompt" in fields or "completion" in fields or ("messages" not in row and "prompt" in row):
        prompt = field_text(row, fields.get("prompt", "prompt"), where)
        completion = field_text(row, fields.get("completion", "completion"), where)
        messages = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": completion}]
        if "system" in fields:
            system = field_text(row, fields["system"], where)
            messages.insert(0, {"role": "system", "content": system})
    else:
        raw = value(row, fields.get("messages", "messages"), where)
        if not isinstance(raw, list):
            raise DataError(f"{where}: messages must be a list of {{role, content}}, got "
                            f"{type(raw).__name__}")
        messages = [message(m, where, i) for i, m in enumerate(raw)]
    check(messages, where)
    return messages


def prompt_messages(row: dict, fields: dict[str, str], where: str) -> list[Message]:
    """A prompt's messages: ``fields["prompt"]`` (default ``prompt``) is text (one user turn),
    a list of messages, or a format string over the row's fields; ``fields["system"]`` adds a
    system message first."""
    path = fields.get("prompt", "prompt")
    if "{" in path:  # a format string over the row's fields
        prompt = [{"role": "user", "content": field_text(row, path, where)}]
    elif isinstance(got := value(row, path, where), str):
        prompt = [{"role": "user", "content": got}]
    elif isinstance(got, list):
        prompt = [message(m, where, i) for i, m in enumerate(got)]
    else:
        raise DataError(f"{where}: prompt must be text or a list of messages, got "
                        f"{type(got).__name__}")
    if "system" in fields:
        prompt.insert(0, {"role": "system", "content": field_text(row, fields["system"], where)})
    return prompt


def message(m: Any, where: str, i: int) -> Message:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
            or not isinstance(m.get("content"), str):
        raise DataError(f"{where}: message {i} must be an object with text fields role and "
                        f"content, got {json.dumps(m)[:80]}")
    return {"role": m["role"], "content": m["content"]}


def check(messages: list[Message], where: str) -> None:
    """One clear error for an unknown role, roles out of order or no assistant turn: an
    optional system message first, then user and assistant turns alternating, user first."""
    for i, m in enumerate(messages):
        if m["role"] not in ROLES:
            raise DataError(f"{where}: message {i} has unknown role {m['role']!r}; roles are "
                            f"{', '.join(ROLES)}")
    turns = messages[1:] if messages and messages[0]["role"] == "system" else messages
    for i, m in enumerate(turns):
        expected = "user" if i % 2 == 0 else "assistant"
        if m["role"] != expected:
            at = i + len(messages) - len(turns)
            raise DataError(f"{where}: message {at} is {m['role']!r} where {expected!r} was due "
                            "(roles out of order: an optional system message, then user and "
                            "assistant turns alternating, user first)")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant turn, so nothing to train on; drop the row or "
                        "add the answer")

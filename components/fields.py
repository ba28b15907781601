"""Fields of JSON rows by dotted path (``"doc.answers.0"``), for task files and chat data:
each miss is one error naming the row and the keys that are there."""

from __future__ import annotations

from typing import Any

from kiln.components.errors import DataError


def value(row: dict[str, Any], path: str, where: str) -> Any:
    """The value at a dotted ``path`` of ``row``; ``where`` ("task 'x': FILE: example 3") starts
    the error message."""
    node: Any = row
    for part in path.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.lstrip("-").isdigit() and \
                -len(node) <= int(part) < len(node):
            node = node[int(part)]
        else:
            keys = sorted(node) if isinstance(node, dict) else type(node).__name__
            raise DataError(f"{where}: no field {path!r} (at {part!r}; there: {keys}); map it "
                            "with fields.NAME = \"PATH\" or fix the file")
    return node


def text(row: dict[str, Any], path: str, where: str) -> str:
    v = value(row, path, where)
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)
    if not isinstance(v, str):
        raise DataError(f"{where}: field {path!r} must be text, got {type(v).__name__}")
    return v

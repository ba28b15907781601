"""`kiln list [KIND]`: every registered component (built-in and plugin), its one-line doc, and
its fields with types and defaults."""

from __future__ import annotations

import json
import re

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from kiln.components import registry


def add_arguments(parser) -> None:
    parser.add_argument("kind", nargs="?", help="only this kind (model, attention, ...)")
    parser.add_argument("--brief", action="store_true", help="names and docs only")


def _default(info) -> str:
    if info.default_factory is not None:
        value = info.default_factory()
        return getattr(value, "type", None) or _inline(value)
    return "required" if info.default is PydanticUndefined else repr(info.default)


def _inline(value) -> str:
    """A config default as a TOML-ish inline table of its non-default keys:
    ``{ ndim = [1] }``, a list of them for list fields."""
    if isinstance(value, list) and all(isinstance(v, BaseModel) for v in value):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    if isinstance(value, BaseModel):
        keys = value.model_dump(exclude_defaults=True)
        if not keys:
            return "{}"
        return "{ " + ", ".join(f"{k} = {json.dumps(v)}" for k, v in keys.items()) + " }"
    return repr(value)


def _type(info) -> str:
    text = re.sub(r"\b(?:typing|kiln\.[\w.]+)\.", "", str(info.annotation))
    return getattr(info.annotation, "__name__", text) if "[" not in text else text


def run(args) -> int:
    if args.kind and args.kind not in registry.kinds():
        print(f"unknown kind {args.kind!r}; kinds: {', '.join(registry.kinds())}"
              f"{registry.did_you_mean(args.kind, registry.kinds())}")
        return 2
    for entry in registry.entries(args.kind):
        print(f"{entry.kind}:{entry.name}  - {entry.doc}  [{entry.origin.split(':')[0]}]")
        if args.brief:
            continue
        for name, info in entry.config.model_fields.items():
            if name == "type":
                continue
            key = info.alias or name
            desc = f"  # {info.description}" if info.description else ""
            print(f"    {key}: {_type(info)} = {_default(info)}{desc}")
    return 0

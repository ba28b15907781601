"""Validating merged recipe data into typed configs, with errors that name the key and the file.

The walk is ours rather than pydantic's alone because a table's schema depends on its ``type``
(the registry decides which config class applies), and because errors must name the file that
set the key, the valid keys and a did-you-mean.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from kiln.components import registry
from kiln.components.base import ComponentConfig, Config, Kind, default_type
from kiln.components.errors import RecipeError
from kiln.recipes.config.loader import Layered

_NOTES: list[str] = []


def take_notes() -> list[str]:
    """Keys dropped because a higher layer switched their component's ``type`` (then cleared)."""
    out = list(_NOTES)
    _NOTES.clear()
    return out


def _kind_of(annotation: Any, metadata: list[Any]) -> tuple[str | None, str]:
    """(component kind, container) for a field: container is "", "dict" or "list"."""
    for m in metadata:
        if isinstance(m, Kind):
            return m.kind, ""
    origin = typing.get_origin(annotation)
    if origin in (dict, list):
        inner = typing.get_args(annotation)[-1]
        if typing.get_origin(inner) is typing.Annotated:
            for m in typing.get_args(inner)[1:]:
                if isinstance(m, Kind):
                    return m.kind, origin.__name__
    return None, ""


def _keys(cls: type[BaseModel]) -> set[str]:
    return {info.alias or name for name, info in cls.model_fields.items()}


def _nested_config(annotation: Any) -> type[Config] | None:
    candidates = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        candidates = [a for a in typing.get_args(annotation) if a is not type(None)]
    for c in candidates:
        if isinstance(c, type) and issubclass(c, Config) and not issubclass(c, ComponentConfig):
            return c
    return None


def _nested_list(annotation: Any) -> type[Config] | None:
    """The item config of a ``list[SomeConfig]`` field (e.g. ``no_decay`` rules)."""
    if typing.get_origin(annotation) is list:
        return _nested_config(typing.get_args(annotation)[0])
    return None


def _fmt(path: str) -> str:
    return path or "<top level>"


def _component(kind: str, data: Any, path: str, layers: Layered,
               implied: str | None = None) -> ComponentConfig | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise RecipeError(
            f"{layers.source(path)}: [{path}] must be a table with type = \"<{kind}>\", "
            f"got {data!r}; choices: {', '.join(registry.names(kind))}"
        )
    name = data.get("type", implied)
    if name is None:
        raise RecipeError(
            f"{layers.source(path)}: [{path}] needs type = \"<{kind} name>\"; choices: "
            f"{', '.join(registry.names(kind))}"
        )
    if not isinstance(name, str):
        raise RecipeError(f"{layers.source(path)}: {path}.type must be a string, got {name!r}")
    try:
        entry = registry.get(kind, name)
    except registry.RegistryError as exc:
        raise RecipeError(f"{layers.source(path + '.type')}: {path}.type: {exc}") from None
    data = {**data, "type": name}
    type_layer = layers.layer(f"{path}.type")
    for key in list(data):
        foreign = key != "type" and key not in _keys(entry.config)
        if foreign and layers.layer(f"{path}.{key}") < type_layer:
            # A higher layer switched the implementation; this key belonged to the old one.
            _NOTES.append(f"{path}.{key} dropped: not a field of {kind} {name!r}")
            del data[key]
    return build_config(entry.config, data, path, layers)


def _section_of(key: str, fields: dict) -> str:
    """" (did you mean training.steps?)" for a key that belongs one table down (``--steps=3``):
    the plain tables only, since a component's keys depend on its type."""
    owners = [f"{name}.{key}" for name, info in fields.items()
              if (nested := _nested_config(info.annotation)) is not None
              and key in {i.alias or n for n, i in nested.model_fields.items()}]
    return f" (did you mean {' or '.join(owners)}?)" if owners else ""


def build_config(cls: type[BaseModel], data: Any, path: str, layers: Layered) -> Any:
    """Validate ``data`` (a dict) against ``cls``; raise RecipeError naming the key and file."""
    if not isinstance(data, dict):
        raise RecipeError(f"{layers.source(path)}: [{path}] must be a table, got {data!r}")
    fields = {info.alias or name: info for name, info in cls.model_fields.items()}
    prefix = f"{path}." if path else ""
    for key in data:
        if key not in fields:
            valid = sorted(fields)
            hint = _section_of(key, fields) or registry.did_you_mean(key, valid)
            raise RecipeError(
                f"{layers.source(prefix + key)}: unknown key {prefix}{key}"
                f"{hint}; valid keys in [{_fmt(path)}]: "
                f"{', '.join(valid)} (see `kiln list`)"
            )
    values: dict[str, Any] = {}
    for key, value in data.items():
        info = fields[key]
        sub = prefix + key
        kind, container = _kind_of(info.annotation, info.metadata)
        nested = _nested_config(info.annotation)
        item = _nested_list(info.annotation)
        if kind and container == "dict" and isinstance(value, dict):
            values[key] = {k: _component(kind, v, f"{sub}.{k}", layers) for k, v in value.items()}
        elif kind and container == "list" and isinstance(value, list):
            values[key] = [_component(kind, v, f"{sub}[{i}]", layers) for i, v in enumerate(value)]
        elif kind and not container:
            values[key] = _component(kind, value, sub, layers, default_type(info))
        elif nested is not None and isinstance(value, dict):
            values[key] = build_config(nested, value, sub, layers)
        elif item is not None and isinstance(value, dict):  # one table for a list of them
            values[key] = [build_config(item, value, sub, layers)]
        elif item is not None and isinstance(value, list):
            values[key] = [build_config(item, v, f"{sub}[{i}]", layers)
                           for i, v in enumerate(value)]
        else:
            values[key] = value
    try:
        return cls.model_validate(values)
    except ValidationError as exc:
        raise RecipeError(_explain(exc, cls, prefix, layers)) from None
    except registry.RegistryError as exc:  # a default sub-component that is not registered
        raise RecipeError(f"{layers.source(path)}: [{_fmt(path)}]: {exc}") from None


def _explain(exc: ValidationError, cls: type[BaseModel], prefix: str, layers: Layered) -> str:
    lines = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"])
        key = prefix + loc
        reason = err["msg"].removeprefix("Value error, ")
        if not err["loc"]:  # a model-level validator: the table, then its reason
            table = prefix.rstrip(".")
            where = f"[{table}]: " if table else ""
            lines.append(f"{_blame(reason, cls, prefix, layers)}: {where}{reason}")
        elif err["type"] == "missing":
            field = cls.model_fields.get(str(err["loc"][0]))
            desc = f" ({field.description})" if field is not None and field.description else ""
            lines.append(f"{layers.source(prefix.rstrip('.'))}: missing required key {key}{desc}")
        else:
            field = cls.model_fields.get(str(err["loc"][0]))
            want = _type_name(field.annotation) if field is not None else ""
            hint = f" (expected {want})" if want else ""
            lines.append(
                f"{layers.source(key)}: {key} = {_short(err.get('input'))}: {reason}{hint}"
            )
    return "\n".join(lines)


def _blame(reason: str, cls: type[BaseModel], prefix: str, layers: Layered) -> str:
    """The file that last set a key the reason names (a model-level check spans several keys,
    also of its sub-tables: "attention.n_heads" in [model]), else the file of the table."""
    named = {f"{prefix}{key}" for key in _keys(cls) if re.search(rf"\b{re.escape(key)}\b", reason)}
    named |= {key for key in layers.sources if key.startswith(prefix) and key != prefix
              and re.search(rf"(?<![\w.]){re.escape(key[len(prefix):])}(?!\w)", reason)}
    set_keys = [k for k in named if layers.layer(k) >= 0]
    if set_keys:
        return layers.source(max(set_keys, key=layers.layer))
    return layers.source(prefix.rstrip("."))


def _short(value: Any, limit: int = 80) -> str:
    """A value as written in the message, cut short (a table's repr can be a page long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + " ..."


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) or str(annotation)
    return text.replace("typing.", "")

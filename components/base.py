"""Typed configs shared by every component: strict pydantic v2 models.

Every config is a ``Config`` (extra keys forbidden, strict types, every field described). A
component's config derives from ``ComponentConfig``, whose ``type`` names the registered
implementation. A field that holds a sub-component is annotated with ``Kind("<kind>")`` so the
recipe loader knows which registry table to look the ``type`` up in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny

from kiln.components import registry


class Config(BaseModel):
    """Base of every kiln config: strict, closed, described."""

    # Fields are described with Field(description=...). Attribute docstrings are not read:
    # pydantic finds them by parsing each class's source file, ~0.3 s of every kiln start.
    model_config = ConfigDict(extra="forbid", strict=True, validate_assignment=True)


class ComponentConfig(Config):
    """Config of a registered component; ``type`` selects the implementation."""

    type: str = Field("", description="registered component name (see `kiln list`)")

    def build(self, *args: Any, **context: Any) -> Any:
        """Build the registered component this config names, passing the parent's context."""
        return registry.for_config(self).obj(self, *args, **context)


@dataclass(frozen=True)
class Kind:
    """Marks a config field as holding a component of ``kind`` (a registry table)."""

    kind: str


def default_config(kind: str, name: str, **values: Any) -> ComponentConfig:
    """A component config with its defaults, as if a recipe wrote ``type = name``."""
    entry = registry.get(kind, name)
    return entry.config(type=name, **values)


def component(kind: str, default: str | None, description: str, implied: str | None = None) -> Any:
    """A field default for a sub-component: ``default`` names the registered implementation.

    A recipe table for this field that omits ``type`` gets ``default`` (or ``implied``, for a
    field whose default is "absent" but whose table, when written, has a natural type)."""
    extra = {"kiln_default_type": default or implied}
    if default is None:
        return Field(None, description=description, json_schema_extra=extra)
    return Field(default_factory=lambda: default_config(kind, default), description=description,
                 json_schema_extra=extra)


def default_type(field: Any) -> str | None:
    """The ``type`` a recipe table gets when it omits one (see ``component``)."""
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    return extra.get("kiln_default_type")


# The type of a sub-component field: serialised with its concrete class's fields.
def Sub(kind: str) -> Any:  # noqa: N802 - reads as a type in annotations
    return Annotated[SerializeAsAny[ComponentConfig], Kind(kind)]


def OptionalSub(kind: str) -> Any:  # noqa: N802
    return Annotated[SerializeAsAny[ComponentConfig] | None, Kind(kind)]


def regex(v: str) -> str:
    """A config field's value that must be a regular expression (its validator's body)."""
    try:
        re.compile(v)
    except re.error as exc:
        raise ValueError(f"{v!r} is not a regular expression: {exc}") from None
    return v

"""Differences between two resolved recipes, as dotted keys grouped by table."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import tomli_w

from kiln.recipes.config.files import to_dict
from kiln.recipes.config.schema import Recipe

# Keys that name a run rather than describe it: equal runs in two folders are still "equal".
IGNORED = ("run.name", "run.folder")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of the leaves. An empty table has no keys and is left out, as in TOML (a
    recipe without ``[optimizers.NAME]`` tables and one with ``optimizers = {}`` are the same)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


def toml_value(value: Any) -> str:
    """``value`` as an inline TOML literal (``true``, ``"causal"``, ``[1, 2]``, ``{ ndim = [1]
    }``): what a recipe or a ``--key=value`` override would say. Scalars are written by tomli_w;
    it writes tables and arrays of tables as sections, so those are composed here."""
    if isinstance(value, dict):
        items = [f"{_toml_key(k)} = {toml_value(v)}" for k, v in value.items()]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return tomli_w.dumps({"v": value})[len("v = "):].rstrip("\n")


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else toml_value(key)


@dataclass
class RecipeDiff:
    only_a: dict[str, Any] = field(default_factory=dict)
    only_b: dict[str, Any] = field(default_factory=dict)
    changed: dict[str, tuple[Any, Any]] = field(default_factory=dict)

    @property
    def equal(self) -> bool:
        return not (self.only_a or self.only_b or self.changed)

    def keys(self) -> list[str]:
        return sorted({*self.only_a, *self.only_b, *self.changed})

    def to_json(self) -> dict[str, Any]:
        return {
            "equal": self.equal,
            "only_a": self.only_a,
            "only_b": self.only_b,
            "changed": {k: {"a": a, "b": b} for k, (a, b) in self.changed.items()},
        }

    def render(self, name_a: str = "A", name_b: str = "B") -> str:
        if self.equal:
            return "recipes are identical"
        lines = [f"--- {name_a}", f"+++ {name_b}"]
        groups: dict[str, list[str]] = {}
        for key in self.keys():
            table, _, leaf = key.rpartition(".")
            if key in self.changed:
                a, b = self.changed[key]
                row = f"  ~ {leaf}: {toml_value(a)} -> {toml_value(b)}"
            elif key in self.only_a:
                row = f"  - {leaf} = {toml_value(self.only_a[key])}"
            else:
                row = f"  + {leaf} = {toml_value(self.only_b[key])}"
            groups.setdefault(table, []).append(row)
        for table in sorted(groups):  # a table before its sub-tables; top-level keys first
            lines.append(f"[{table}]" if table else "[<top level>]")
            lines += groups[table]
        return "\n".join(lines)


def diff(a: Recipe, b: Recipe, ignore: tuple[str, ...] = IGNORED) -> RecipeDiff:
    fa, fb = flatten(to_dict(a)), flatten(to_dict(b))
    out = RecipeDiff()
    for key in sorted(set(fa) | set(fb)):
        if key in ignore:
            continue
        if key not in fb:
            out.only_a[key] = fa[key]
        elif key not in fa:
            out.only_b[key] = fb[key]
        elif fa[key] != fb[key]:
            out.changed[key] = (fa[key], fb[key])
    return out


ABSENT = "-"  # how a table shows a key one recipe does not have (another component type)


def differing(recipes: list[Recipe], ignore: tuple[str, ...] = IGNORED) -> dict[str, list[Any]]:
    """The keys whose values are not the same in all ``recipes``, each with its value per
    recipe (``ABSENT`` where a recipe lacks it), in key order: what tells runs apart."""
    flat = [flatten(to_dict(r)) for r in recipes]
    keys = sorted(set().union(*flat) - set(ignore))
    out = {}
    for key in keys:
        values = [f.get(key, ABSENT) for f in flat]
        if any(v != values[0] for v in values[1:]):
            out[key] = values
    return out


def short_names(keys: list[str]) -> dict[str, str]:
    """Each dotted key by its last part when no other key shares it (``optimizer.lr`` -> ``lr``),
    else by the shortest unambiguous tail (``model.ffn.hidden_dim`` -> ``ffn.hidden_dim``)."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if not any(k != key and (k == tail or k.endswith("." + tail)) for k in keys):
                break
        out[key] = tail
    return out


def settings_label(diffs: dict[str, list[Any]], i: int) -> str:
    """Recipe ``i``'s values of the ``differing`` keys, by their short names: ``lr=0.001,
    steps=60`` ("" when nothing differs); how plot legends and seed points name a run."""
    short = short_names(list(diffs))
    return ", ".join(f"{short[k]}={f'{v[i]:g}' if isinstance(v[i], float) else v[i]}"
                     for k, v in diffs.items())

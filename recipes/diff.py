"""Differences between two resolved recipes, as dotted keys grouped by table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.recipes.recipe import to_dict
from kiln.recipes.schema import Recipe

# Keys that name a run rather than describe it: equal runs in two folders are still "equal".
IGNORED = ("run.name", "run.folder")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, path + "."))
        else:
            out[path] = value
    return out


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
            table = key.rpartition(".")[0] or "<top level>"
            leaf = key.rpartition(".")[2]
            if key in self.changed:
                a, b = self.changed[key]
                groups.setdefault(table, []).append(f"  ~ {leaf}: {a!r} -> {b!r}")
            elif key in self.only_a:
                groups.setdefault(table, []).append(f"  - {leaf} = {self.only_a[key]!r}")
            else:
                groups.setdefault(table, []).append(f"  + {leaf} = {self.only_b[key]!r}")
        for table, rows in groups.items():
            lines.append(f"[{table}]")
            lines += rows
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

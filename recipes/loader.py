"""Reading recipes: TOML files, ``extends`` chains and ``--a.b=c`` overrides, merged in layers.

Precedence, lowest first: component defaults < the ``extends`` chain (deepest base first) < the
recipe file < command-line overrides. Every key remembers the layer it came from, so errors name
the file (or "command line") that set it.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.components.errors import RecipeError

CLI = "command line"


@dataclass
class Layered:
    """Merged recipe data plus, per dotted key, the (layer index, source label) that set it."""

    data: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, tuple[int, str]] = field(default_factory=dict)

    def source(self, path: str) -> str:
        """The file that set ``path`` or its nearest ancestor table."""
        while path:
            if path in self.sources:
                return self.sources[path][1]
            path = path.rpartition(".")[0]
        return self.sources.get("", (0, "recipe"))[1]

    def layer(self, path: str) -> int:
        return self.sources.get(path, (-1, ""))[0]


def read_toml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read recipe ({exc.strerror})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: TOML syntax error: {exc}") from None


def _merge(dst: Layered, src: dict[str, Any], layer: int, label: str, prefix: str = "") -> None:
    for key, value in src.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            existing = dst_get(dst.data, path)
            if not isinstance(existing, dict):
                dst_set(dst.data, path, {})
            dst.sources.setdefault(path, (layer, label))
            _merge(dst, value, layer, label, path + ".")
        else:
            dst_set(dst.data, path, value)
            dst.sources[path] = (layer, label)


def dst_get(data: dict[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def dst_set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = data
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = value


def _chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict[str, Any]]]:
    """The file and its ``extends`` ancestors, deepest base first."""
    path = path.resolve()
    if path in seen:
        cycle = " -> ".join(display(p) for p in (*seen, path))
        raise RecipeError(f"{display(path)}: `extends` cycle: {cycle}; remove one of the links")
    data = read_toml(path)
    base = data.pop("extends", None)
    if base is None:
        return [(path, data)]
    if not isinstance(base, str):
        raise RecipeError(f"{path}: key 'extends' must be a string path to a recipe, got {base!r}")
    base_path = (path.parent / base).resolve()
    if not base_path.exists():
        raise RecipeError(
            f"{path}: key 'extends' names {base!r}, but {base_path} does not exist "
            "(paths are relative to the recipe that extends them)"
        )
    return [*_chain(base_path, (*seen, path)), (path, data)]


def parse_override(arg: str) -> tuple[str, Any]:
    """``--section.key=value`` -> (dotted key, TOML literal value; bare words are strings)."""
    if not arg.startswith("--") or "=" not in arg:
        raise RecipeError(
            f"bad override {arg!r}: write --section.key=value (e.g. --training.steps=7, "
            "--optimizer.lr=3e-4, --model.attention.type=\"differential\")"
        )
    key, _, text = arg[2:].partition("=")
    parts = key.split(".")
    if not key or any(not p or not p.replace("_", "").replace("-", "").isalnum() for p in parts):
        raise RecipeError(f"bad override {arg!r}: key {key!r} must be dotted names like a.b.c")
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        bare = text.replace("_", "").replace("-", "").replace(".", "").replace("/", "")
        if not text or not bare.isalnum():
            raise RecipeError(
                f"bad override {arg!r}: {text!r} is not a TOML value (quote strings: "
                f"--{key}='\"...\"')"
            ) from None
        value = text  # a bare word such as `differential` or a path such as runs/x
    return key, value


def display(path: Path) -> str:
    """A path as the user would write it: relative to the working folder when inside it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def load_layers(path: str | Path, overrides: list[str] = ()) -> Layered:
    """Merge a recipe's ``extends`` chain, the recipe, then the overrides."""
    merged = Layered()
    chain = _chain(Path(path))
    for index, (file, data) in enumerate(chain):
        _merge(merged, data, index, display(file))
    merged.sources[""] = (len(chain) - 1, display(chain[-1][0]))
    cli_layer = len(chain)
    for arg in overrides:
        key, value = parse_override(arg)
        parent = key.rpartition(".")[0]
        if parent and dst_get(merged.data, parent) is not None and not isinstance(
            dst_get(merged.data, parent), dict
        ):
            raise RecipeError(f"bad override {arg!r}: {parent!r} is a value, not a table")
        if isinstance(value, dict):
            _merge(merged, value, cli_layer, CLI, key + ".")
        else:
            dst_set(merged.data, key, value)
            merged.sources[key] = (cli_layer, CLI)
    return merged

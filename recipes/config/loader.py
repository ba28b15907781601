"""Reading recipes: TOML files, ``extends`` chains and ``--a.b=c`` overrides, merged in layers.

Precedence, lowest first: component defaults < the ``extends`` chain (deepest base first) < the
recipe file < command-line overrides. Every key remembers the layer it came from, so errors name
the file (or "command line") that set it.

A file can also take inherited tables away: ``remove = ["guards.spike", ...]`` drops those
dotted paths from the files below it before it merges, and a file that writes one of a group of
exclusive tables (``[optimizer]`` vs ``[optimizers.NAME]``) replaces the others set below it.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.components.errors import RecipeError
from kiln.components.registry import did_you_mean

CLI = "command line"


@dataclass
class Layered:
    """Merged recipe data plus, per dotted key, the (layer index, source label) that set it."""

    data: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, tuple[int, str]] = field(default_factory=dict)

    def source(self, path: str) -> str:
        """The file that set ``path`` or its nearest ancestor table (list items such as
        ``no_decay[0]`` belong to their list)."""
        path = re.sub(r"\[\d+\]", "", path)
        while path:
            if path in self.sources:
                return self.sources[path][1]
            path = path.rpartition(".")[0]
        return self.sources.get("", (0, "recipe"))[1]

    def layer(self, path: str) -> int:
        return self.sources.get(path, (-1, ""))[0]


def read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise RecipeError(f"{path}: recipe file not found") from None
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read recipe ({exc.strerror})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise RecipeError(
            f"{display(path)}: line {line}: byte 0x{raw[exc.start]:02x} is not UTF-8 text; "
            "TOML files must be UTF-8: re-save the file as UTF-8 (e.g. `iconv -f latin1 -t "
            "utf-8`)"
        ) from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RecipeError(f"{path}: TOML syntax error: {exc}") from None


def _merge(dst: Layered, src: dict[str, Any], layer: int, label: str, prefix: str = "") -> None:
    for key, value in src.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            existing = dst_get(dst.data, path)
            if not isinstance(existing, dict):  # a new table, or a table over a lower value
                dst_set(dst.data, path, {})
                dst.sources[path] = (layer, label)
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
    """The file and its ``extends`` ancestors, deepest base first (``remove`` stays in data)."""
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
        if text.startswith(("[", "{")):  # the shell took the quotes off the items
            raise RecipeError(
                f"bad override {arg!r}: {text!r} is not a TOML value (a list's strings need "
                "quotes, which the shell removes unless the whole value is in single quotes: "
                f"--{key}='[\"a\", \"b\"]')") from None
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


def _removals(data: dict[str, Any], label: str) -> list[str]:
    """The file's ``remove = [...]`` list of dotted paths (popped from ``data``)."""
    value = data.pop("remove", [])
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise RecipeError(
            f"{label}: key 'remove' must be a list of dotted paths of inherited tables or keys, "
            f"e.g. remove = [\"guards.spike\", \"optimizer\"]; got {value!r}"
        )
    return value


def _drop(merged: Layered, path: str) -> None:
    """Forget ``path`` (a table or a key) and where its parts came from."""
    *parents, last = path.split(".")
    node = dst_get(merged.data, ".".join(parents)) if parents else merged.data
    if isinstance(node, dict):
        node.pop(last, None)
    for key in [k for k in merged.sources if k == path or k.startswith(path + ".")]:
        del merged.sources[key]


def _remove(merged: Layered, paths: list[str], label: str) -> None:
    for path in paths:
        if dst_get(merged.data, path) is None:
            known = sorted(k for k in merged.sources if k)
            hint = did_you_mean(path, known)
            raise RecipeError(
                f"{label}: remove names {path!r}, which no recipe below this one sets{hint}; "
                "remove lists inherited tables or keys (dotted paths, e.g. \"guards.spike\")"
            )
        _drop(merged, path)


def _replace_exclusive(merged: Layered, keys: set[str],
                       exclusive: tuple[tuple[str, ...], ...]) -> None:
    """A file writing one table of an exclusive group (``keys``: the non-empty tables it
    writes) replaces the others set below it."""
    for group in exclusive:
        written = [k for k in group if k in keys]
        for other in group:
            if written and other not in written and other in merged.data:
                _drop(merged, other)


def load_layers(path: str | Path, overrides: list[str] = (),
                exclusive: tuple[tuple[str, ...], ...] = ()) -> Layered:
    """Merge a recipe's ``extends`` chain, the recipe, then the overrides. ``exclusive`` lists
    groups of top-level tables of which a layer's choice replaces what lower layers set (e.g.
    ``("optimizer", "optimizers")``)."""
    merged = Layered()
    chain = _chain(Path(path))
    for index, (file, data) in enumerate(chain):
        label = display(file)
        _remove(merged, _removals(data, label), label)
        _replace_exclusive(merged, {k for k, v in data.items() if v != {}}, exclusive)
        _merge(merged, data, index, label)
    merged.sources[""] = (len(chain) - 1, display(chain[-1][0]))
    cli_layer = len(chain)
    for arg in overrides:
        key, value = parse_override(arg)
        parent = key.rpartition(".")[0]
        if parent and dst_get(merged.data, parent) is not None and not isinstance(
            dst_get(merged.data, parent), dict
        ):
            raise RecipeError(f"bad override {arg!r}: {parent!r} is a value, not a table")
        parts = key.split(".")
        for i in range(1, len(parts)):  # tables the override creates are the command line's
            merged.sources.setdefault(".".join(parts[:i]), (cli_layer, CLI))
        if isinstance(value, dict):
            _merge(merged, value, cli_layer, CLI, key + ".")
        else:
            dst_set(merged.data, key, value)
            merged.sources[key] = (cli_layer, CLI)
    _check_exclusive(merged, exclusive)
    return merged


def _check_exclusive(merged: Layered, exclusive: tuple[tuple[str, ...], ...]) -> None:
    """Tables of an exclusive group written in one layer (or the second one on the command
    line, where a typo must not silently replace the recipe's table) are an error."""
    for group in exclusive:
        present = [k for k in group if merged.data.get(k, {}) != {}]
        if len(present) > 1:
            where = " and ".join(f"[{_table_name(merged.data, k)}] ({merged.source(k)})"
                                 for k in present)
            raise RecipeError(
                f"{where}: use one of them, not both. A recipe that extends another may switch "
                "(its table replaces the inherited one); on the command line, override keys of "
                "the table the recipe uses"
            )


def _table_name(data: dict[str, Any], key: str) -> str:
    """``optimizers.muon`` for a table of named tables, else ``key``."""
    value = data.get(key)
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return f"{key}.{next(iter(value))}"
    return key

"""Imports run one way: leaf modules at the bottom, then components, parallelisms, checkpointing,
and the trainer and CLI (recipes) on top. Checked on the source, imports inside functions
included (a lazy import is still a dependency)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from tests.conftest import REPO

FLOORS = {"components": 0, "parallelisms": 1, "checkpointing": 2, "recipes": 3}
LEAVES = {  # module -> the kiln modules it may import
    "kiln.components.errors": set(),
    "kiln.components.registry": set(),
    "kiln.components.devices": {"kiln.components.errors"},
    "kiln.components.distributed": {"kiln.components.errors", "kiln.components.devices"},
    "kiln.components.caching": set(),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return "kiln." + ".".join(parts)


def _imports(path: Path, name: str) -> set[str]:
    """Every kiln module ``path`` imports (``from kiln.x import y`` counts y when y is a module)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("kiln.")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            if base.startswith("kiln"):
                found.add(base)
                found |= {f"{base}.{a.name}" for a in node.names}
    return found


@functools.cache  # the source does not change during a session; callers only read it
def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for top in FLOORS for p in (REPO / top).rglob("*.py")}
    return {name: {m for m in _imports(path, name) if m in files and m != name}
            for name, path in files.items()}


def test_graph_is_not_empty():
    graph = _graph()
    assert len(graph) > 50 and sum(map(len, graph.values())) > 100


def test_leaf_modules_import_nothing_else_of_kiln():
    graph = _graph()
    for leaf, allowed in LEAVES.items():
        extra = graph[leaf] - allowed - {"kiln.components"}
        assert not extra, f"{leaf} imports {sorted(extra)}"


def test_no_package_imports_a_higher_floor():
    bad = []
    for name, deps in _graph().items():
        floor = FLOORS[name.split(".")[1]]
        bad += [f"{name} -> {d}" for d in deps if FLOORS[d.split(".")[1]] > floor]
    assert not bad, "imports running up:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    # The package __init__ modules that only re-export are edges of their own: drop an edge into
    # a package __init__ from its own sub-modules (Python runs the __init__ first anyway).
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph[node]):
            if node.startswith(dep + "."):
                continue  # a module importing its own package
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


# The rooms of the top floor, bottom to top: a room imports only rooms below it (cli.py, the
# entry point, may import any). docs/design.md "Floors" draws the same tree.
RECIPES_ROOMS = ["probes", "config", "runs", "loading", "inference", "hooks", "preflight",
                 "training", "scaling", "commands.models",
                 "commands.scaling", "commands"]


def _room(module: str) -> str:
    """The folder a module lives in: ``kiln.recipes.hooks.log`` -> ``kiln.recipes.hooks``."""
    return module if module in _packages() else module.rpartition(".")[0]


@functools.cache  # asked for every import edge by _room
def _packages() -> set[str]:
    return {_module_name(p.parent / "__init__.py") for top in FLOORS
            for p in (REPO / top).rglob("__init__.py")}


def test_recipes_rooms_import_only_rooms_below():
    rank = {f"kiln.recipes.{r}": i for i, r in enumerate(RECIPES_ROOMS)}
    assert set(rank) | {"kiln.recipes"} == {p for p in _packages()
                                             if p.startswith("kiln.recipes")}, \
        "a new folder under recipes/ needs its place in RECIPES_ROOMS"
    bad = []
    for name, deps in _graph().items():
        src = rank.get(_room(name))
        bad += [f"{name} -> {d}" for d in deps
                if src is not None and rank.get(_room(d), -1) > src]
    assert not bad, "imports running up between recipes' rooms:\n" + "\n".join(sorted(bad))


def _siblings(src: str, dst: str) -> tuple[str, str] | None:
    """The two sibling folders an import from room ``src`` to room ``dst`` runs between: each
    room's ancestor just below their deepest common folder (``kiln.components.data.chat`` ->
    ``kiln.components.tokenizers``: ``...data`` -> ``...tokenizers``); None within one line of
    folders (a folder and its own subfolder)."""
    a, b = src.split("."), dst.split(".")
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    if common in (len(a), len(b)):
        return None
    return ".".join(a[:common + 1]), ".".join(b[:common + 1])


def test_no_cycle_between_sibling_folders():
    """Folders that share a parent never import each other both ways (through any chain),
    nested folders included: an import from ``data/chat`` into ``tokenizers`` is one from
    ``data`` into ``tokenizers``."""
    edges: dict[str, set[str]] = {}
    for name, deps in _graph().items():
        for d in deps:
            pair = _siblings(_room(name), _room(d))
            if pair is not None:
                edges.setdefault(pair[0], set()).add(pair[1])

    def reaches(a: str, b: str, seen: set[str]) -> bool:
        return any(n == b or (n not in seen and reaches(n, b, seen | {n}))
                   for n in edges.get(a, ()))

    cycles = sorted(f"{a} <-> {b}" for a in edges for b in edges[a] if reaches(b, a, {b}))
    assert not cycles, "folders importing each other:\n" + "\n".join(cycles)


def test_no_folder_holds_more_than_a_dozen_modules():
    """Rooms of one job: a folder past 12 modules wants splitting (the package's __init__
    aside)."""
    crowded = {}
    for pkg in (REPO / top for top in FLOORS):
        for folder in [pkg, *[p.parent for p in pkg.rglob("__init__.py")]]:
            modules = [p for p in folder.glob("*.py") if p.name != "__init__.py"]
            if len(modules) > 12:
                crowded[str(folder.relative_to(REPO))] = len(modules)
    assert not crowded, crowded


@pytest.mark.parametrize("old, new", [
    ("kiln.components.data.chat.templates", "kiln.components.tokenizers.chat_templates"),
    ("kiln.components.data.sources.text_sources", "kiln.components.sources.text_sources"),
    ("kiln.components.data.sources.source_files", "kiln.components.sources.source_files"),
    ("kiln.components.data.sources.hub_datasets", "kiln.components.sources.hub_datasets"),
])
def test_a_moved_module_still_imports_from_its_old_path_with_a_warning(old, new):
    """For one release: a plugin importing the old path keeps working, and is told where to."""
    import importlib
    import sys
    import warnings

    sys.modules.pop(old, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    moved = importlib.import_module(new)
    public = [n for n, v in vars(moved).items() if not n.startswith("_")
              and getattr(v, "__module__", None) == new]  # its own functions and classes
    assert public and all(getattr(module, n) is getattr(moved, n) for n in public)
    assert any(issubclass(w.category, DeprecationWarning) and new in str(w.message)
               for w in caught)

"""Load a recipe file into a validated ``Recipe`` and write resolved recipes back as TOML."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import tomli_w

from kiln.components.errors import RecipeError
from kiln.recipes.config.loader import load_layers
from kiln.recipes.config.resolve import build_config, take_notes
from kiln.recipes.config.schema import Recipe


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, merge and validate a recipe; fill the derived defaults (run name and folder)."""
    path = Path(path)
    if path.is_dir():
        path = _recipe_in_folder(path)
    layers = load_layers(path, list(overrides), exclusive=Recipe.exclusive_tables)
    take_notes()
    recipe = build_config(Recipe, layers.data, "", layers)
    for note in take_notes():
        print(f"kiln: note: {note}", file=sys.stderr)
    if not recipe.run.name:
        recipe.run.name = path.stem if path.name != "recipe.toml" else path.parent.name
    if not recipe.run.folder:
        recipe.run.folder = str(Path("runs") / recipe.run.name)
    return recipe


def _recipe_in_folder(folder: Path) -> Path:
    """A run or checkpoint folder holds its resolved recipe as recipe.toml."""
    for candidate in (folder / "recipe.toml", folder / "meta" / "recipe.toml"):
        if candidate.is_file():
            return candidate
    raise RecipeError(
        f"{folder}: no recipe.toml in this folder; give a recipe file, a run folder or a "
        "checkpoint folder"
    )


def to_dict(recipe: Recipe) -> dict[str, Any]:
    """The resolved recipe as plain data (None values omitted: TOML has no null)."""
    return recipe.model_dump(mode="python", by_alias=True, exclude_none=True)


def to_toml(recipe: Recipe) -> str:
    return tomli_w.dumps(to_dict(recipe))


def kiln_version() -> str:
    """The installed kiln's version ("unknown" when run from a tree that is not installed)."""
    from importlib import metadata

    try:
        return metadata.version("kiln")
    except metadata.PackageNotFoundError:
        return "unknown"


def render_recipe(recipe: Recipe) -> str:
    """The resolved recipe as TOML, headed by the kiln version and git revision (comments)."""
    return f"# resolved by kiln {kiln_version()}, git {git_revision()}\n" + to_toml(recipe)


def write_recipe(recipe: Recipe, path: Path) -> None:
    write_text_atomic(Path(path), render_recipe(recipe))


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file of this process's own (pid in the
    name), so writers racing on one path (every rank writing the same recipe) never rename each
    other's temporary file away; the last rename wins, and each renamed file is whole."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def git_revision() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"

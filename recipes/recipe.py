"""Load a recipe file into a validated ``Recipe`` and write resolved recipes back as TOML."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import tomli_w

from kiln.recipes.errors import RecipeError
from kiln.recipes.loader import load_layers
from kiln.recipes.resolve import build_config, take_notes
from kiln.recipes.schema import Recipe


def load_recipe(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Read, merge and validate a recipe; fill the derived defaults (run name and folder)."""
    path = Path(path)
    if path.is_dir():
        path = _recipe_in_folder(path)
    layers = load_layers(path, list(overrides))
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

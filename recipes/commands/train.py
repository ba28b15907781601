"""`kiln train RECIPE [--key=value ...]`: train a recipe (one process, or one per torchrun rank)."""

from __future__ import annotations

from kiln.recipes.config.files import load_recipe


def add_arguments(parser) -> None:
    parser.add_argument("recipe", help="recipe file (or a run folder to continue)")


def run(args) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    from kiln.components import distributed
    from kiln.recipes.runs.lock import hold_run_folder
    from kiln.recipes.training.trainer import Trainer

    ok = False
    try:
        world = distributed.init(recipe.training.device, recipe.parallelism.backend)
        with hold_run_folder(recipe.run.folder, world):  # one run per folder (run_lock.py)
            Trainer(recipe).fit()
        ok = True
    finally:
        distributed.shutdown(together=ok)
    return 0

"""`kiln train RECIPE [--key=value ...]`: train a recipe (one process, or one per torchrun rank)."""

from __future__ import annotations

from kiln.recipes.recipe import load_recipe

TAKES_OVERRIDES = True  # kiln --help of the command shows them (recipes/cli.py)
EPILOG = ("Several processes: NGPU=N ./run_train.sh RECIPE [--key=value ...] "
          "(torchrun; NNODES, NODE_RANK and RDZV_ENDPOINT for several nodes).")


def add_arguments(parser) -> None:
    parser.add_argument("recipe", help="recipe file (or a run folder to continue)")


def run(args) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    from kiln.components import distributed
    from kiln.recipes.run_lock import hold_run_folder
    from kiln.recipes.trainer import Trainer

    ok = False
    try:
        world = distributed.init(recipe.training.device, recipe.parallelism.backend)
        with hold_run_folder(recipe.run.folder, world):  # one run per folder (run_lock.py)
            Trainer(recipe).fit()
        ok = True
    finally:
        distributed.shutdown(together=ok)
    return 0

"""`kiln train RECIPE [--key=value ...]`: train a recipe (one process, or one per torchrun rank)."""

from __future__ import annotations

from recipes.recipe import load_recipe


def add_arguments(parser) -> None:
    parser.add_argument("recipe", help="recipe file (or a run folder to continue)")


def run(args) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    from recipes import distributed
    from recipes.trainer import Trainer

    try:
        trainer = Trainer(recipe)
        trainer.fit()
        # Leave together: a rank tearing down its gloo connections while a peer still uses
        # them can abort the peer ("terminate called without an active exception").
        distributed.barrier()
    finally:
        distributed.shutdown()
    return 0

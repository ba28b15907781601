"""`kiln train RECIPE [--key=value ...]`: train a recipe (one process, or one per torchrun rank)."""

from __future__ import annotations

from pathlib import Path

from kiln.components.errors import KilnError
from kiln.recipes.config.files import load_recipe

TAKES_OVERRIDES = True  # kiln --help of the command shows them (recipes/cli.py)
EPILOG = ("Several processes: NGPU=N ./run_train.sh RECIPE [--key=value ...] "
          "(torchrun; NNODES, NODE_RANK and RDZV_ENDPOINT for several nodes).")


def add_arguments(parser) -> None:
    parser.add_argument("recipe", help="recipe file (or a run folder to continue)")


def run(args) -> int:
    recipe = load_recipe(args.recipe, args.overrides)
    from kiln.components import distributed
    from kiln.recipes.runs.lock import hold_run_folder
    from kiln.recipes.training.trainer import Trainer

    ok, world = False, None
    try:
        # The one init of the process group: the trainer's own later call finds it up, so the
        # recipe's timeout and flight recorder must be given here.
        pcfg = recipe.parallelism
        world = distributed.init(recipe.training.device, pcfg.backend,
                                 timeout_s=pcfg.collective_timeout_s,
                                 flight_recorder=pcfg.flight_recorder)
        with hold_run_folder(recipe.run.folder, world):  # one run per folder (run_lock.py)
            Trainer(recipe).fit()
        ok = True
    except Exception as exc:
        if world is not None and world.distributed and not isinstance(exc, KilnError):
            # a collective failed or timed out: what each rank last issued, for the post-mortem
            from kiln.recipes.hooks.watchdog import dump_flight_recorder

            dump_flight_recorder(Path(recipe.run.folder) / "hang", world.rank)
        raise
    finally:
        distributed.shutdown(together=ok)
    return 0

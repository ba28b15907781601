"""`kiln harness ARGS...`: lm-evaluation-harness's own command line with the ``kiln`` model
registered (the harness 0.4.x discovers no models through entry points), so every harness flag
works: ``kiln harness --model kiln --model_args path=runs/debug --tasks TASK.yaml --device cpu``.
Needs the ``eval`` extra (``pip install 'kiln[eval]'``)."""

from __future__ import annotations

import importlib.util
import sys

from kiln.components.errors import RecipeError

RAW_ARGS = True  # cli.main hands the arguments over untouched (no recipe overrides)


def add_arguments(parser) -> None:
    parser.add_argument("args", nargs="*", help="lm-evaluation-harness arguments (lm-eval --help)")


def run_harness(argv: list[str]) -> int:
    """Run the harness command line on ``argv``; its exit status."""
    if importlib.util.find_spec("lm_eval") is None:
        raise RecipeError("kiln harness needs lm-evaluation-harness: pip install 'kiln[eval]' "
                          "(or pip install 'lm-eval>=0.4.13,<0.5')")
    from lm_eval.__main__ import cli_evaluate

    import kiln.recipes.inference.harness_model  # noqa: F401  (registers --model kiln)

    saved = sys.argv
    sys.argv = ["kiln harness", *argv]
    try:
        cli_evaluate()
    except SystemExit as exc:  # argparse's --help and usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = saved
    return 0


def run(args) -> int:
    return run_harness(args.argv)

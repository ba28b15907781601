"""`kiln harness ARGS...`: lm-evaluation-harness's own command line with the ``kiln`` model
registered (the harness 0.4.x discovers no models through entry points), so every harness flag
works: ``kiln harness --model kiln --model_args path=runs/debug --tasks TASK.yaml --device cpu``.
``--help`` prints kiln's part (the model and its arguments) before the harness's own help.
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

    from kiln.recipes.inference.harness_model import MODEL_ARGS  # registers --model kiln

    if not argv or "-h" in argv or "--help" in argv:
        print(kiln_help(MODEL_ARGS))
    saved = sys.argv
    sys.argv = ["kiln harness", *argv]
    try:
        cli_evaluate()
    except SystemExit as exc:  # argparse's --help and usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except ValueError as exc:
        if not _raised_by_harness(exc):  # kiln's model raises its own error types
            raise
        hint = ("; `kiln harness ls tasks` lists the harness's tasks, and a task YAML file's "
                "path works in place of a name" if "Tasks not found" in str(exc) else "")
        raise RecipeError(f"lm-evaluation-harness: {exc}{hint}") from None
    finally:
        sys.argv = saved
    return 0


def _raised_by_harness(exc: BaseException) -> bool:
    """The harness's own refusal of its arguments (an unknown task, a bad --model_args), which
    it reports as a bare ValueError: its innermost frame is in lm_eval's code."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "lm_eval" in tb.tb_frame.f_globals.get("__name__", "")


def kiln_help(model_args: dict[str, str]) -> str:
    width = max(map(len, model_args)) + 2
    return "\n".join([
        "kiln harness: lm-evaluation-harness's command line with kiln's model registered:",
        "  kiln harness --model kiln --model_args path=RUN[,step=N,batch_size=16,...] "
        "--tasks TASKS --device cpu",
        "",
        "kiln model arguments (--model_args KEY=VALUE,...; batch_size and device given here win "
        "over --batch_size / --device):",
        *(f"  {name:<{width}}{text}" for name, text in model_args.items()),
        "",
        "lm-evaluation-harness's own help:",
        "",
    ])


def run(args) -> int:
    return run_harness(args.argv)

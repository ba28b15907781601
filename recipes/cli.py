"""The ``kiln`` command line. Each subcommand lives in its own module, imported only when used,
so ``kiln --help`` and ``kiln show`` start without importing the training stack.

A subcommand module defines ``add_arguments(parser)`` and ``run(args) -> int`` (exit status).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from kiln.components.errors import KilnError
from kiln.components.registry import RegistryError
from kiln.recipes.config.loader import parse_override
from kiln.recipes.runs import launch

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("kiln.recipes.commands.train", "train a recipe: kiln train RECIPE [--key=value ...]"),
    "validate": ("kiln.recipes.commands.validate", "build every component on the meta device"),
    "show": ("kiln.recipes.commands.show", "print the resolved recipe as TOML"),
    "list": ("kiln.recipes.commands.list", "list registered components, their fields and defaults"),
    "diff": ("kiln.recipes.commands.diff", "compare two recipes, run folders or checkpoints"),
    "bench": ("kiln.recipes.commands.bench", "measure tokens/s, MFU, memory of a recipe"),
    "eval": ("kiln.recipes.commands.models.eval",
             "a checkpoint's held-out loss (--loops 1,2,4,8: per loop count of a looped model) "
             "or downstream task scores (--tasks NAME,...; --pending: a paused run's)"),
    "data": ("kiln.recipes.commands.data",
             "prepare a dataset folder from text: packed documents or balanced_shards shards"),
    "tokenizer": ("kiln.recipes.commands.tokenizer",
                  "train a byte-level BPE tokenizer on local text (offline)"),
    "export": ("kiln.recipes.commands.models.export",
               "checkpoint -> safetensors + config.json (Hugging Face layout when it has one)"),
    "import": ("kiln.recipes.commands.models.import_model",
               "Hugging Face model -> recipe that continues training it (checkpoint.init_from)"),
    "generate": ("kiln.recipes.commands.models.generate",
                 "sample text from a run's checkpoint (KV cache, streaming, batched prompts)"),
    "harness": ("kiln.recipes.commands.models.harness",
                "lm-evaluation-harness with the kiln model: kiln harness --model kiln "
                "--model_args path=RUN --tasks ..."),
    "compare": ("kiln.recipes.commands.compare",
                "one table: recipe keys that differ between runs beside their results"),
    "plot": ("kiln.recipes.commands.plot",
             "overlay runs' curves (legend: what differs), expert-load heatmap; a PNG"),
    "ladder": ("kiln.recipes.commands.scaling.ladder",
               "one recipe as a ladder of model sizes with token budgets (tokens per parameter "
               "or iso-FLOP), trained in turn (resumable) or as a SLURM array"),
    "mup": ("kiln.recipes.commands.scaling.mup",
            "mup check RECIPE --widths ...: the µP coordinate check (layer sizes per width, "
            "under µP and the standard parametrization; a table and a PNG)"),
    "fit": ("kiln.recipes.commands.scaling.fit",
            "fit a scaling law (Chinchilla L(N, D), L(N), L(C)) to one or two ladders, with "
            "bootstrap intervals, the target's prediction and where two curves cross"),
    "sweep": ("kiln.recipes.commands.sweep",
              "train a grid of overrides one run after another (resumable) or as a SLURM array"),
}

# The epilog of a command whose module sets TAKES_OVERRIDES (its usage line gets the overrides).
OVERRIDES_HELP = ("--key=value: a recipe key after the recipe overrides its TOML, e.g. "
                  "--training.steps=100 --optimizer.lr=3e-3 (kiln list shows the keys).")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="kiln: composable LLM training recipes. Recipe keys can be overridden with "
        "--section.key=value after the recipe path.",
    )
    parser.add_argument("--version", action="store_true",
                        help="print kiln's version, git revision and torch's version")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Arguments are added lazily in main() so --help of one command imports only it.
    return parser


def _torch_version() -> str:
    """torch's version without importing torch (``kiln --version`` answers at once)."""
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "not installed"


def _looks_like_override(arg: str, options: set[str]) -> bool:
    """``--a.b=c``; ``--key=value`` when ``--key`` is none of the command's options (a top-level
    key such as ``--description=...``, or ``--steps=3`` for ``--training.steps``: the recipe
    loader names the key and suggests, where argparse said "unrecognized arguments")."""
    key = arg.split("=", 1)[0]
    if arg.startswith("--") and "=" in arg and key not in options:
        return True
    return (arg.startswith("--") and "." in key) or ("=" in arg and "." in key and "/" not in key)


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's actions and its subcommands' (``kiln data prepare --out=...``), read from
    argparse's own lists: it has no public way to list them."""
    found = []
    for action in parser._actions:
        found.append(action)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _actions(sub)
    return found


def _split_overrides(parser: argparse.ArgumentParser,
                     args: list[str]) -> tuple[list[str], list[str]]:
    actions = _actions(parser)
    options = {opt for action in actions for opt in action.option_strings}
    takes_value = {opt for action in actions if action.nargs != 0 for opt in action.option_strings}
    overrides, rest = [], []
    for i, arg in enumerate(args):
        if _looks_like_override(arg, options) and not (i and args[i - 1] in takes_value):
            overrides.append(arg)
        else:
            rest.append(arg)
    return overrides, rest


def main(argv: list[str] | None = None) -> int:
    launch.bind_to_launcher()  # a torchrun worker of kiln.recipes.runs.launch dies with it
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv[:1] == ["--version"]:
        from kiln.recipes.config.files import git_revision, kiln_version

        print(f"kiln {kiln_version()} (git {git_revision()}, torch {_torch_version()})")
        return 0
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"kiln: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}",
                  file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    if getattr(module, "RAW_ARGS", False):  # a command with its own parser (kiln harness)
        argv_rest = argv[1:]
        try:
            return int(module.run(argparse.Namespace(argv=argv_rest, overrides=[])) or 0)
        except KilnError as exc:
            return _fail(name, exc.exit_code, str(exc))
    overrides_too = getattr(module, "TAKES_OVERRIDES", False)
    epilog = " ".join(t for t in (OVERRIDES_HELP if overrides_too else "",
                                  getattr(module, "EPILOG", "")) if t)
    cmd_parser = argparse.ArgumentParser(prog=f"kiln {name}", description=COMMANDS[name][1],
                                         epilog=epilog or None)
    module.add_arguments(cmd_parser)
    if overrides_too:  # not argparse options (split off below): the usage line says so
        usage = cmd_parser.format_usage().removeprefix("usage: ").rstrip()
        cmd_parser.usage = f"{usage} [--key=value ...]"
    # Recipe overrides (--a.b=c) are not argparse options: split them off first (not the
    # value of an option of the command: `kiln sweep R --grid optimizer.lr=1e-3,3e-3`).
    overrides, rest = _split_overrides(cmd_parser, argv[1:])
    args, unknown = cmd_parser.parse_known_args(rest)  # parse_args, with a hint on what is left
    if unknown:
        hint = ("; recipe overrides are one word each, --section.key=value (e.g. "
                "--training.steps=3)" if overrides_too and unknown[0].startswith("--") else "")
        cmd_parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    args.overrides = overrides
    try:
        for arg in overrides:
            parse_override(arg)  # syntax errors before any work
        return int(module.run(args) or 0)
    except KilnError as exc:
        return _fail(name, exc.exit_code, str(exc))
    except RegistryError as exc:
        return _fail(name, 2, str(exc))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kiln show ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception:
        if not _under_torchrun():
            raise
        # A bug, or a consequence of another rank's error (a peer left a collective): the
        # launcher decides which to show (kiln.recipes.runs.launch).
        if not launch.write_report({"kind": "exception", "traceback": traceback.format_exc()}):
            raise
        _exit_now(1)


def _under_torchrun() -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def _fail(name: str, status: int, message: str) -> int:
    """Print kiln's one-message error (or hand it to ``kiln.recipes.runs.launch``); exit status."""
    report = {"kind": "kiln", "prefix": f"kiln {name}", "exit_code": status, "message": message}
    if not (_under_torchrun() and launch.write_report(report)):
        print(f"kiln {name}: error: {message}", file=sys.stderr)
    if _under_torchrun():
        _exit_now(status)
    return status


def _exit_now(status: int) -> None:
    """Leave a torchrun worker at once: an orderly exit tears down gloo connections that peers
    may still use and can abort ("terminate called without an active exception"), turning
    kiln's exit status into SIGABRT."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())

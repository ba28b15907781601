"""`kiln sweep RECIPE --grid KEY=V1,V2 [--grid ...] [--seeds N] [--out DIR] [--emit slurm]
[--key=value ...]`: train every point of a grid one after another (resumable), then print
`kiln compare` of the sweep; or write a SLURM job-array script instead of running."""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
from pathlib import Path

from kiln.components.errors import RecipeError, RunFolderInUse
from kiln.recipes.config.files import load_recipe
from kiln.recipes.runs.launch import die_with_parent
from kiln.recipes.runs.lock import RunLock, holder_of
from kiln.recipes.runs.sweep import expand, mark_done, parse_grid, slurm_script

CLAIM = "sweep.lock"  # a point's folder, held by the sweep training it (run_lock.RunLock)

TAKES_OVERRIDES = True  # kiln --help of the command shows them (recipes/cli.py)


def add_arguments(parser) -> None:
    parser.add_argument("recipe", help="recipe file")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                        help="a recipe key and its values (repeat for more keys: every "
                        "combination runs)")
    parser.add_argument("--seeds", type=int, default=0, metavar="N",
                        help="also repeat every point with N seeds (training.seed = the "
                        "recipe's seed + 0 .. N-1)")
    parser.add_argument("--out", default="", help="sweep folder holding one run folder per "
                        "point (default: <run.folder>-sweep, e.g. runs/debug-sweep)")
    parser.add_argument("--emit", choices=["slurm"], default=None,
                        help="write DIR/sweep.sbatch (a SLURM job array) instead of running")


def _train_command(recipe: str, args: list[str]) -> list[str]:
    """One process: kiln's trainer under this interpreter. NGPU / NNODES > 1: run_train.sh of
    the working folder (torchrun with kiln's error reporting, as for a single run)."""
    if int(os.environ.get("NGPU", "1")) <= 1 and int(os.environ.get("NNODES", "1")) <= 1:
        return [sys.executable, "-m", "kiln.recipes.cli", "train", recipe, *args]
    script = Path("run_train.sh")
    if not (script.is_file() and os.access(script, os.X_OK)):
        raise RecipeError("NGPU / NNODES > 1 needs ./run_train.sh: run kiln sweep from the kiln "
                          "checkout (where run_train.sh is)")
    return ["./run_train.sh", recipe, *args]


def run(args) -> int:
    if args.seeds < 0:
        raise RecipeError(f"--seeds {args.seeds}: give 0 or more")
    base = load_recipe(args.recipe, args.overrides)
    grid = parse_grid(args.grid, args.seeds, base.training.seed)
    sweep_dir = Path(args.out or f"{base.run.folder}-sweep")
    points = expand(grid, sweep_dir)
    for point in points:  # every point resolves (unknown keys, bad values) before any runs
        load_recipe(args.recipe, [*args.overrides, *point.overrides])
    print(f"kiln sweep: {len(points)} runs of {args.recipe} under {sweep_dir}/")
    if args.emit == "slurm":
        sweep_dir.mkdir(parents=True, exist_ok=True)
        path = sweep_dir / "sweep.sbatch"
        path.write_text(slurm_script(args.recipe, list(args.overrides), points, sweep_dir,
                                     Path.cwd(), f"kiln-{base.run.name}"), encoding="utf-8")
        path.chmod(0o755)
        print(f"kiln sweep: wrote {path}; submit: sbatch {path}\n"
              f"then: kiln compare {sweep_dir}/*")
        return 0
    failed = train_points(args.recipe, list(args.overrides), points)
    shown = [str(p.folder) for p in points if (p.folder / "metrics.jsonl").is_file()]
    if shown:
        from kiln.recipes.commands.compare import report, verdicts

        print(report(shown, width=120))
        for line in verdicts(shown):  # a winner only where the difference is beyond noise
            print(f"kiln sweep: {line}")
    if failed:
        print("kiln sweep: failed runs (rerun the sweep to continue them):\n  "
              + "\n  ".join(failed), file=sys.stderr)
        return 1
    return 0


def train_points(recipe: str, extra: list[str], points, tag: str = "kiln sweep") -> list[str]:
    """Train each point not yet finished, one after another; a point another sweep holds is
    trained after the others (when that sweep lets go of it). The failed points' lines."""
    failed, busy = [], []

    def train(i: int, point) -> None:
        if point.finished:  # also by another sweep of the same grid
            print(f"{tag}: [{i}/{len(points)}] {point.folder} finished; skipped")
            return
        what = ", ".join(f"{k}={v}" for k, v in point.values)
        state = "continues" if (point.folder / "recipe.toml").is_file() else "starts"
        print(f"{tag}: [{i}/{len(points)}] {what} {state} in {point.folder}", flush=True)
        cmd = _train_command(recipe, [*extra, *point.overrides])
        # the run dies with the sweep (kill -9 of it too): a rerun continues the point alone
        status = subprocess.call(cmd, preexec_fn=functools.partial(die_with_parent, os.getpid()))
        if status == 0:
            mark_done(point)
        else:
            failed.append(f"{point.folder} (exit {status}): {shlex.join(cmd)}")

    for i, point in enumerate(points, 1):
        try:  # the point is this sweep's while it trains it and records the outcome
            claim = RunLock.take(point.folder, tag, name=CLAIM)
        except RunFolderInUse:
            print(f"{tag}: [{i}/{len(points)}] {point.folder} is being trained by another "
                  f"sweep ({holder_of(point.folder / CLAIM)}); back to it after the other points",
                  flush=True)
            busy.append((i, point))
            continue
        try:
            train(i, point)
        finally:
            claim.release()
    for i, point in busy:  # then wait for the other sweep: it may also stop before the end
        print(f"{tag}: [{i}/{len(points)}] waiting for the other sweep to end "
              f"{point.folder}", flush=True)
        claim = RunLock.take(point.folder, tag, name=CLAIM, wait=True)
        try:
            train(i, point)
        finally:
            claim.release()
    return failed

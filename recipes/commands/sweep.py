"""`kiln sweep RECIPE --grid KEY=V1,V2 [--grid ...] [--seeds N] [--out DIR] [--emit slurm]
[--key=value ...]`: train every point of a grid one after another (resumable), then print
`kiln compare` of the sweep; or write a SLURM job-array script instead of running."""

from __future__ import annotations

import sys
from pathlib import Path

from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe
from kiln.recipes.runs.sweep import expand, parse_grid, slurm_script
from kiln.recipes.runs.train_points import train_points

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

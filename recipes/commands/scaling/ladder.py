"""`kiln ladder RECIPE --sizes W1,W2,... [--tokens-per-param R | --flops C1,C2] [--depth
scaled|fixed] [--out DIR] [--emit slurm] [--plan] [--key=value ...]`: one recipe as a ladder of
model sizes (the rule: ``recipes/scaling/ladder.py``), each a run folder under DIR, trained one
after another (resumable: a finished size is skipped) or as a SLURM array; then
``kiln fit DIR`` fits it."""

from __future__ import annotations

import sys
from pathlib import Path

from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe
from kiln.recipes.runs.sweep import slurm_script
from kiln.recipes.runs.train_points import train_points
from kiln.recipes.scaling.ladder import DEPTHS, parse_numbers, plan, write_plan

TAKES_OVERRIDES = True  # kiln --help of the command shows them (recipes/cli.py)


def add_arguments(parser) -> None:
    parser.add_argument("recipe", help="the base recipe (its model is the ladder's shape)")
    parser.add_argument("--sizes", required=True, metavar="W1,W2,...",
                        help="model widths (model.dim); depth, heads and FFN follow the rule "
                        "in docs/scaling.md")
    parser.add_argument("--depth", choices=DEPTHS, default="scaled",
                        help="scaled: n_layers keeps the base width-to-depth ratio; fixed: the "
                        "base depth at every size")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--tokens-per-param", type=float, default=20.0, metavar="R",
                        help="each size trains on R x its non-embedding parameters (20: "
                        "Hoffmann et al.'s compute-optimal ratio)")
    budget.add_argument("--flops", default="", metavar="C1,C2",
                        help="an iso-FLOP grid: every size at every compute budget")
    parser.add_argument("--out", default="", help="the ladder folder (default: "
                        "<run.folder>-ladder)")
    parser.add_argument("--emit", choices=["slurm"], default=None,
                        help="write DIR/sweep.sbatch (a SLURM job array) instead of running")
    parser.add_argument("--plan", action="store_true",
                        help="write DIR/recipes/*.toml and DIR/ladder.json, print the sizes, "
                        "train nothing")


def run(args) -> int:
    if args.tokens_per_param <= 0:
        raise RecipeError(f"--tokens-per-param {args.tokens_per_param}: give a positive ratio")
    widths = parse_numbers(args.sizes, "--sizes", int)
    flops = parse_numbers(args.flops, "--flops") if args.flops else None
    base = load_recipe(args.recipe, args.overrides)
    ladder_dir = Path(args.out or f"{base.run.folder}-ladder")
    points = plan(args.recipe, list(args.overrides), widths, ladder_dir, depth=args.depth,
                  tokens_per_param=args.tokens_per_param, flops=flops)
    write_plan(ladder_dir, args.recipe, list(args.overrides), points)
    print(f"kiln ladder: {len(points)} sizes of {args.recipe} under {ladder_dir}/ "
          f"(recipes: {ladder_dir}/recipes/)")
    for p in points:
        print(f"  {p.folder.name:<14} " + " ".join(f"{k.split('.')[-1]}={v}" for k, v in
                                                   p.values))
    if args.plan:
        return 0
    if args.emit == "slurm":
        path = ladder_dir / "sweep.sbatch"
        path.write_text(slurm_script(args.recipe, list(args.overrides), points, ladder_dir,
                                     Path.cwd(), f"kiln-ladder-{base.run.name}"),
                        encoding="utf-8")
        path.chmod(0o755)
        print(f"kiln ladder: wrote {path}; submit: sbatch {path}\nthen: kiln fit {ladder_dir}")
        return 0
    failed = train_points(args.recipe, list(args.overrides), points, tag="kiln ladder")
    if failed:
        print("kiln ladder: failed sizes (rerun the ladder to continue them):\n  "
              + "\n  ".join(failed), file=sys.stderr)
        return 1
    print(f"kiln ladder: every size finished; fit it: kiln fit {ladder_dir}")
    return 0

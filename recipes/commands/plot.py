"""`kiln plot RUN... [--metrics loss,eval/loss,lr,grad_norm] [--x step|tokens|time] [--smooth N]
[--join] [--each-seed] --out FILE.png`: overlay runs' curves (legend: what differs between their
recipes; runs that differ only in their seed as one mean line in a band); a
run started from another run's checkpoint at its true offset (``--join``: one line with its
parent); mixture stage switches marked; MoE runs add an expert-load heatmap. Needs matplotlib
(the `plot` extra)."""

from __future__ import annotations

from kiln.components.errors import RecipeError
from kiln.recipes.runs.plots import DEFAULT_METRICS, X_LABELS, draw
from kiln.recipes.runs.read import open_runs


def add_arguments(parser) -> None:
    parser.add_argument("runs", nargs="+", help="run folders (runs/<name>)")
    parser.add_argument("--metrics", default="", help="comma-separated metric names; a name "
                        "also selects its sub-keys (lr -> lr/main, ...); default: "
                        f"{','.join(DEFAULT_METRICS)} and each in-loop task's score (those "
                        "logged)")
    parser.add_argument("--x", choices=list(X_LABELS), default="step",
                        help="x axis: step, tokens seen, or training time in seconds")
    parser.add_argument("--smooth", type=int, default=1, metavar="N",
                        help="trailing moving average over N logged points (default 1: raw)")
    parser.add_argument("--no-experts", action="store_true",
                        help="leave out the expert-load heatmap of MoE runs")
    parser.add_argument("--join", action="store_true",
                        help="draw a run started from another run's checkpoint (an anneal, a "
                        "fine-tune; its parent.json) and that parent as one line")
    parser.add_argument("--each-seed", action="store_true",
                        help="a line per run even where runs differ only in training.seed "
                        "(default: such runs are one line, their mean, in a band from their "
                        "lowest to their highest value)")
    parser.add_argument("--out", required=True, help="the PNG file to write")


def run(args) -> int:
    if args.overrides:
        raise RecipeError(f"kiln plot takes run folders, not overrides: {args.overrides[0]}")
    if args.smooth < 1:
        raise RecipeError(f"--smooth {args.smooth}: give a window of 1 or more points")
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()] or None
    runs = open_runs(args.runs)
    path = draw(runs, args.out, metrics=metrics, x=args.x, smooth_n=args.smooth,
                experts=not args.no_experts, join=args.join, each_seed=args.each_seed)
    print(f"kiln plot: wrote {path} ({len(runs)} run{'s' * (len(runs) > 1)})")
    return 0

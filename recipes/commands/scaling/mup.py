"""`kiln mup check RECIPE --widths 64,128,256`: the µP coordinate check. A few steps at each
width under µP and under the standard parametrization; every layer's output size and how far
it moved, as a table and a PNG; the layers whose updates grow with width under µP named (exit
status 1), since there they should not (``recipes/scaling/coords.py``; docs/scaling.md)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe
from kiln.recipes.scaling import coords as cc
from kiln.recipes.scaling.ladder import parse_numbers

TAKES_OVERRIDES = True  # kiln --help of the command shows them (recipes/cli.py)


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=["check"], help="check: the coordinate check")
    parser.add_argument("recipe", help="a transformer recipe (its model.base_dim is µP's base)")
    parser.add_argument("--widths", default="64,128,256", metavar="W1,W2,...",
                        help="model widths, resized by kiln ladder's rule at fixed depth")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per width")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--factor", type=float, default=2.0,
                        help="a layer whose update grows more than this from the narrowest "
                        "width to the widest is reported")
    parser.add_argument("--out", default="", help="the PNG (default: <run.folder>-coords.png)")
    parser.add_argument("--json", action="store_true", help="print the measurements as JSON")


def run(args) -> int:
    widths = parse_numbers(args.widths, "--widths", int)
    if len(widths) < 2 or args.steps < 1:
        raise RecipeError("kiln mup check needs two widths or more and --steps of 1 or more")
    base = load_recipe(args.recipe, args.overrides)
    if base.model.type != "transformer":
        raise RecipeError(f"model.type = {base.model.type!r}: µP is implemented for the "
                          "transformer family (dense, differential attention, MoE)")
    unused = [what for what, used in (
        (f"checkpoint.init_from = {base.checkpoint.init_from!r}", base.checkpoint.init_from),
        (f"training.step.type = {base.training.step.type!r}",
         base.training.step.type != "standard"),  # (looped models are refused above)
        ("[adapter]", base.adapter is not None)) if used]
    if unused:
        print(f"kiln mup check: note: {', '.join(unused)} not used: the check trains the "
              "recipe's model and optimizers from random weights on next-token loss over "
              "random tokens", file=sys.stderr)
    results = [cc.measure(args.recipe, list(args.overrides), widths, steps=args.steps,
                          batch=args.batch, seq_len=args.seq_len, parametrization=p)
               for p in ("mup", "standard")]
    mup = results[0]
    bad = cc.growing(mup, args.factor)
    if args.json:
        print(json.dumps({c.parametrization: {"widths": c.widths, "size": c.size,
                                              "change": c.change} for c in results}))
    else:
        print(f"mean |output - output at step 0| after {args.steps} steps, per layer and width "
              f"(base_dim {base.model.base_dim}); growth: widest over narrowest")
        print(cc.table(results))
    out = Path(args.out or f"{base.run.folder}-coords.png")
    from kiln.recipes.scaling.plot import draw_coords

    print(f"wrote {draw_coords(results, out)}", file=sys.stderr if args.json else sys.stdout)
    for name, g in bad:
        print(f"kiln mup check: {name} grows x{g:.2f} under µP from width {mup.widths[0]} to "
              f"{mup.widths[-1]} (more than --factor {args.factor}): not µP", file=sys.stderr)
    if not bad:
        print(f"kiln mup check: every layer's update stays within x{args.factor} across widths "
              "under µP", file=sys.stderr if args.json else sys.stdout)
    return 1 if bad else 0

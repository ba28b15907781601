"""`kiln fit LADDER... `: fit a scaling law to one or two ladders, with bootstrap intervals.

Each LADDER is a CSV of params,tokens,loss rows or a folder of run folders (``kiln ladder``
writes one). The fit is Hoffmann et al.'s approach 3 (``recipes/scaling/laws.py``); intervals
come from bootstrap refits (``recipes/scaling/bootstrap.py``); with two ladders the command
also prints where their curves cross and the difference at the target with its interval.
docs/scaling.md explains the output and when not to trust it.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kiln.components.errors import RecipeError
from kiln.recipes.scaling import bootstrap
from kiln.recipes.scaling.curves import (
    AXIS,
    Fitted,
    Target,
    check_target,
    crossings,
    predict,
    search_range,
)
from kiln.recipes.scaling.laws import FitError, fit
from kiln.recipes.scaling.points import LOSSES, PARAM_COUNTS, Ladder, read_ladder

FORMS = ("auto", "chinchilla", "params", "compute")
FORMULAS = {"chinchilla": "L = E + A / N^alpha + B / D^beta", "params": "L = E + A / N^alpha",
            "compute": "L = E + A / C^alpha"}


def add_arguments(parser) -> None:
    parser.add_argument("ladders", nargs="+", metavar="LADDER",
                        help="a CSV (params,tokens,loss[,flops,label]) or a folder of run "
                        "folders; two ladders are compared")
    parser.add_argument("--form", choices=FORMS, default="auto",
                        help="chinchilla L(N, D), params L(N) or compute L(C); auto: "
                        "chinchilla when tokens vary apart from parameters, else params")
    parser.add_argument("--loss", choices=LOSSES, default="eval",
                        help="run folders: the last eval/loss, or the mean training loss over "
                        "the last tenth of the steps")
    parser.add_argument("--params", choices=PARAM_COUNTS, default="non-embedding",
                        help="run folders: count the embedding table or not")
    parser.add_argument("--target-params", type=float, metavar="N")
    parser.add_argument("--target-tokens", type=float, metavar="D")
    parser.add_argument("--target-flops", type=float, metavar="C")
    parser.add_argument("--bootstrap", type=int, default=1000, metavar="B",
                        help="bootstrap refits for the intervals (0: none)")
    parser.add_argument("--scheme", choices=bootstrap.SCHEMES, default="residuals",
                        help="resample the fit's residuals (fixed design) or whole points")
    parser.add_argument("--level", type=float, default=0.95, help="interval coverage")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", metavar="PNG", help="draw points, curves and bands")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def pick_form(requested: str, ladders: list[Ladder]) -> str:
    """auto: chinchilla when log D is not a linear function of log N on every ladder (a fixed
    tokens-per-parameter ratio makes the two terms inseparable), else params."""
    if requested != "auto":
        return requested
    if all(len(ladder.points) >= 6 and separable(ladder) for ladder in ladders):
        return "chinchilla"
    return "params"


def separable(ladder: Ladder) -> bool:
    """Whether log D is not a linear function of log N (else the chinchilla form's two terms
    cannot be told apart)."""
    design = np.stack([np.ones(len(ladder.points)), np.log(ladder.column("params")),
                       np.log(ladder.column("tokens"))], axis=1)
    return np.linalg.matrix_rank(design, tol=1e-6) == 3


def fit_ladder(ladder: Ladder, form: str, args) -> Fitted:
    x = ladder.column("flops" if form == "compute" else "params")
    tokens, loss = ladder.column("tokens"), ladder.column("loss")
    if form == "chinchilla" and not separable(ladder):
        raise FitError(f"{ladder.name}: tokens grow in proportion to parameters (one "
                       "tokens-per-parameter ratio), so A/N^alpha and B/D^beta cannot be "
                       "told apart: fit --form params or compute, or add a second ratio")
    try:
        law = fit(form, x, loss, tokens)
    except FitError as exc:
        raise FitError(f"{ladder.name}: {exc}") from None
    samples = bootstrap.draw(law, x, loss, tokens, n=max(args.bootstrap, 0), seed=args.seed,
                             level=args.level, scheme=args.scheme)
    k = float(np.median(ladder.column("flops") / (ladder.column("params") * tokens)))
    return Fitted(ladder, law, samples, k)


def summarise(fits: list[Fitted], target: Target, level: float) -> dict:
    has_bands = len(fits[0].samples.theta) > 0
    out = {"form": fits[0].law.form, "formula": FORMULAS[fits[0].law.form], "level": level,
           "bootstrap": len(fits[0].samples.theta), "scheme": fits[0].samples.scheme,
           "ladders": []}
    preds = []
    for f in fits:
        bands = f.samples.param_intervals() if has_bands else {}
        entry = {"name": f.ladder.name, "points": len(f.ladder.points),
                 "residual_rms_log": f.residual_rms(), "at_bound": list(f.law.at_bound),
                 "params": {k: {"value": v, "interval": bands.get(k)}
                            for k, v in f.law.params().items()}}
        if target.given():
            value, spread = predict(f, target)
            preds.append((value, spread))
            entry["prediction"] = {"target": target.describe(), "loss": value,
                                   "interval": f.samples.interval(spread) if has_bands else None}
        out["ladders"].append(entry)
    if len(fits) == 2:
        lo, hi = search_range(fits)
        out["crossings"] = [{"at": x, "axis": AXIS[fits[0].law.form][1], "lower_above": name}
                            for x, name in crossings(fits[0], fits[1], lo, hi)]
        out["crossing_search"] = [lo, hi]
        if preds:
            diff = preds[1][1] - preds[0][1]
            out["difference"] = {
                "of": f"{fits[1].ladder.name} - {fits[0].ladder.name}",
                "target": target.describe(), "loss": preds[1][0] - preds[0][0],
                "interval": fits[0].samples.interval(diff) if has_bands else None}
    return out


def render(summary: dict) -> str:
    pct = f"{summary['level']:.0%}"
    lines = [f"form {summary['form']}: {summary['formula']}; {summary['bootstrap']} bootstrap "
             f"refits ({summary['scheme']}), {pct} intervals"]
    for lad in summary["ladders"]:
        lines.append(f"{lad['name']}: {lad['points']} points, log-loss residual rms "
                     f"{lad['residual_rms_log']:.4f}")
        for name, p in lad["params"].items():
            band = p["interval"]
            lines.append(f"  {name:<6} {p['value']:>12.5g}" +
                         (f"  [{band[0]:.5g}, {band[1]:.5g}]" if band else ""))
        for name in lad["at_bound"]:
            lines.append(f"  warning: {name} ended on its bound: the data do not pin it down")
        if "prediction" in lad:
            pr = lad["prediction"]
            band = pr["interval"]
            lines.append(f"  predicted loss at {pr['target']}: {pr['loss']:.4f}" +
                         (f"  [{band[0]:.4f}, {band[1]:.4f}]" if band else ""))
    if "crossings" in summary:
        lo, hi = summary["crossing_search"]
        if not summary["crossings"]:
            lines.append(f"the curves do not cross between {lo:.3g} and {hi:.3g} "
                         f"{AXIS[summary['form']][1]}")
        for c in summary["crossings"]:
            lines.append(f"the curves cross at {c['at']:.4g} {c['axis']}; {c['lower_above']} is "
                         "lower above it")
    if "difference" in summary:
        d = summary["difference"]
        band = d["interval"]
        lines.append(f"difference ({d['of']}) at {d['target']}: {d['loss']:+.4f}" +
                     (f"  [{band[0]:+.4f}, {band[1]:+.4f}]" if band else ""))
    return "\n".join(lines)


def run(args) -> int:
    if len(args.ladders) > 2:
        raise RecipeError("kiln fit takes one ladder, or two to compare")
    if not 0 < args.level < 1:
        raise RecipeError(f"--level {args.level}: an interval's coverage is between 0 and 1")
    ladders = [read_ladder(p, loss=args.loss, params=args.params) for p in args.ladders]
    form = pick_form(args.form, ladders)
    target = Target(args.target_params, args.target_tokens, args.target_flops)
    try:
        if target.given():
            check_target(form, target)
        fits = [fit_ladder(ladder, form, args) for ladder in ladders]
    except FitError as exc:
        raise RecipeError(str(exc)) from None
    summary = summarise(fits, target, args.level)
    print(json.dumps(summary, indent=2) if args.json else render(summary))
    if args.plot:
        from kiln.recipes.scaling.plot import draw

        path = draw(fits, args.plot, target)
        print(f"wrote {path}", file=sys.stderr if args.json else sys.stdout)
    return 0

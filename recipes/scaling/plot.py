"""`kiln fit --plot`: each ladder's points, its fitted curve and the bootstrap band, on log
axes of the form's own x (parameters, or FLOPs along the compute-optimal frontier), with the
target marked and any crossing drawn."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from kiln.recipes.runs.plots import require_matplotlib, save
from kiln.recipes.scaling.curves import AXIS, Fitted, Target, crossings, search_range


def draw(fits: list[Fitted], out: str | Path, target: Target) -> Path:
    plt = require_matplotlib("kiln fit --plot")
    form = fits[0].law.form
    xs_all = np.concatenate([f.axis() for f in fits])
    lo, hi = float(xs_all.min()) / 2, float(xs_all.max()) * 2
    goal = _target_x(form, target)
    if goal is not None:
        lo, hi = min(lo, goal / 2), max(hi, goal * 2)
    xs = np.logspace(math.log10(lo), math.log10(hi), 200)
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, f in enumerate(fits):
        color = f"C{i}"
        ax.scatter(f.axis(), f.ladder.column("loss"), color=color, s=18, zorder=3)
        ax.plot(xs, f.curve(xs), color=color, label=f"{f.ladder.name} ({_exponents(f)})")
        if len(f.samples.theta):
            tail = 100 * (1 - f.samples.level) / 2
            band = np.percentile(f.curve_samples(xs), [tail, 100 - tail], axis=0)
            ax.fill_between(xs, band[0], band[1], color=color, alpha=0.2, linewidth=0)
    if len(fits) == 2:
        for x, _ in crossings(fits[0], fits[1], *search_range(fits)):
            if lo <= x <= hi:
                ax.axvline(x, color="grey", linestyle=":", label=f"cross at {x:.3g}")
    if goal is not None:
        ax.axvline(goal, color="black", linestyle="--", linewidth=0.8, label="target")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(AXIS[form][1])
    ax.set_ylabel("loss")
    if form == "chinchilla":
        ax.set_title("points at their FLOPs; curves: the compute-optimal frontier")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = save(fig, out)
    plt.close(fig)
    return path


def _target_x(form: str, target: Target) -> float | None:
    if form == "params":
        return target.params
    return target.flops


def _exponents(f: Fitted) -> str:
    law = f.law
    if law.form == "chinchilla":
        return f"alpha {law.alpha:.3f}, beta {law.beta:.3f}, E {law.E:.3f}"
    return f"alpha {law.alpha:.3f}, E {law.E:.3f}"


def draw_coords(results, out: str | Path) -> Path:
    """The coordinate check: one panel per parametrization, each layer's update size (mean
    |output - output at step 0| after the last step) against width, on log axes."""
    plt = require_matplotlib("kiln mup check")
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), sharey=True)
    for ax, coords in zip(np.atleast_1d(axes), results, strict=True):
        for name, by_width in coords.change.items():
            ax.plot(coords.widths, [by_width[w][-1] for w in coords.widths], marker="o",
                    linewidth=1, label=name if len(coords.change) <= 12 else None)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("width (model.dim)")
        ax.set_title(f"{coords.parametrization}: update size per layer")
    np.atleast_1d(axes)[0].set_ylabel("mean |h_t - h_0|")
    if len(results[0].change) <= 12:
        np.atleast_1d(axes)[-1].legend(fontsize=7)
    fig.tight_layout()
    path = save(fig, out)
    plt.close(fig)
    return path

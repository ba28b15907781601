"""What a fitted ladder says: its curve along one axis, the loss it predicts at a target, and
where two ladders' curves cross.

The axis is the form's own: parameters for ``params``, FLOPs for ``compute``; for the
``chinchilla`` form it is compute along the compute-optimal frontier (the best split of each
FLOP budget into N and D, ``Law.optimal_loss``), the curve a researcher extrapolates. FLOPs of a
chinchilla ladder map to N D through the ladder's own ratio k = C / (N D) (6 when FLOPs are
6 N D; a little more when they count attention, as kiln's do).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kiln.recipes.scaling.bootstrap import Samples
from kiln.recipes.scaling.laws import FitError, Law
from kiln.recipes.scaling.points import Ladder

AXIS = {"params": ("params", "parameters"), "compute": ("flops", "FLOPs"),
        "chinchilla": ("flops", "FLOPs (compute-optimal)")}


@dataclass(frozen=True)
class Fitted:
    ladder: Ladder
    law: Law
    samples: Samples
    k: float  # FLOPs per parameter-token of this ladder (C = k N D)

    def axis(self) -> np.ndarray:
        return self.ladder.column(AXIS[self.law.form][0])

    def curve(self, xs: np.ndarray) -> np.ndarray:
        if self.law.form == "chinchilla":
            return self.law.optimal_loss(xs, self.k)
        return self.law.predict(xs)

    def curve_samples(self, xs: np.ndarray) -> np.ndarray:
        """Each bootstrap refit's curve at ``xs``, (B, len(xs))."""
        if self.law.form != "chinchilla":
            return self.samples.predictions(xs)
        e, a, alpha, b, beta = (self.samples.theta[:, i:i + 1] for i in range(5))
        s = alpha + beta
        g = (alpha * np.exp(a) / (beta * np.exp(b))) ** (1.0 / s)
        c = np.asarray(xs, dtype=np.float64)[None, :] / self.k
        n = g * c ** (beta / s)
        return np.exp(e) + np.exp(a) / n**alpha + np.exp(b) / (c / n) ** beta

    def residual_rms(self) -> float:
        """Root-mean-square of the log-space residuals at the ladder's points."""
        d = self.ladder.column("tokens") if self.law.form == "chinchilla" else None
        x = self.ladder.column("flops" if self.law.form == "compute" else "params")
        r = np.log(self.law.predict(x, d)) - np.log(self.ladder.column("loss"))
        return float(np.sqrt(np.mean(r * r)))


@dataclass(frozen=True)
class Target:
    params: float | None = None
    tokens: float | None = None
    flops: float | None = None

    def given(self) -> bool:
        return any(v is not None for v in (self.params, self.tokens, self.flops))

    def describe(self) -> str:
        parts = [f"{k}={v:.3g}" for k, v in (("N", self.params), ("D", self.tokens),
                                              ("C", self.flops)) if v is not None]
        return ", ".join(parts)


def check_target(form: str, target: Target) -> None:
    """One line when the target does not name what the form predicts from."""
    if form == "params" and (target.params is None or target.tokens or target.flops):
        raise FitError("the params form predicts from --target-params alone")
    if form == "compute" and (target.flops is None or target.params or target.tokens):
        raise FitError("the compute form predicts from --target-flops alone")
    if form == "chinchilla":
        given = (target.params is not None, target.tokens is not None, target.flops is not None)
        if given not in ((True, True, False), (False, False, True)):
            raise FitError("the chinchilla form predicts from --target-params with "
                           "--target-tokens, or from --target-flops alone (the compute-optimal "
                           "split)")


def predict(fitted: Fitted, target: Target) -> tuple[float, np.ndarray]:
    """The predicted loss at ``target`` and each bootstrap refit's, (B,)."""
    law = fitted.law
    if law.form == "chinchilla" and target.flops is None:
        value = float(law.predict([target.params], [target.tokens])[0])
        return value, fitted.samples.predictions([target.params], [target.tokens])[:, 0]
    x = target.params if law.form == "params" else target.flops
    return float(fitted.curve(np.array([x]))[0]), fitted.curve_samples(np.array([x]))[:, 0]


def crossings(a: Fitted, b: Fitted, lo: float, hi: float) -> list[tuple[float, str]]:
    """Where curve ``a`` meets curve ``b`` between ``lo`` and ``hi`` on the shared axis: each
    crossing and which ladder is lower above it."""
    from scipy.optimize import brentq

    if a.law.form != b.law.form:
        raise FitError("two ladders are compared under one form (--form)")
    xs = np.logspace(math.log10(lo), math.log10(hi), 4001)
    gap = a.curve(xs) - b.curve(xs)
    out = []
    for i in np.nonzero(np.sign(gap[:-1]) * np.sign(gap[1:]) < 0)[0]:
        root = brentq(lambda lx: float(a.curve(np.array([10**lx]))[0]
                                       - b.curve(np.array([10**lx]))[0]),
                      math.log10(xs[i]), math.log10(xs[i + 1]))
        x = 10**root
        above = a.curve(np.array([x * 1.01]))[0] < b.curve(np.array([x * 1.01]))[0]
        out.append((x, a.ladder.name if above else b.ladder.name))
    return out


def search_range(fits: list[Fitted]) -> tuple[float, float]:
    """The span searched for crossings: from a thousandth of the smallest point to a million
    times the largest (a crossing beyond it would be an extrapolation of six decades)."""
    xs = np.concatenate([f.axis() for f in fits])
    return float(xs.min()) / 1e3, float(xs.max()) * 1e6

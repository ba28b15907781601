"""Scaling-law forms and their fit: Hoffmann et al. 2022 ("Chinchilla"), approach 3.

    chinchilla   L(N, D) = E + A / N**alpha + B / D**beta
    params       L(N)    = E + A / N**alpha          (a ladder at one tokens-per-parameter ratio)
    compute      L(C)    = E + A / C**alpha          (C: training FLOPs)

The fit follows approach 3: in log space, with ``e = log E``, ``a = log A``, ``b = log B``, the
predicted log loss is ``LSE(a - alpha log N, b - beta log D, e)``; the parameters minimise the
Huber loss (delta 1e-3) between it and the observed log loss, from a grid of starting points,
keeping the best. The paper runs L-BFGS from every point of its grid; here the grid (the
paper's) is scored in one vectorised pass, its best ``starts`` points are optimised together by
the batched solver (``solver.py``), and scipy's L-BFGS-B polishes the best of them to a tight
tolerance (the analytic gradient is ``solver.objective``). A fit takes tens of milliseconds.

Besiroglu et al. 2024 ("Chinchilla scaling: a replication attempt") found that the paper's
optimiser stopped early and that its reported intervals were too narrow to be right; kiln runs
L-BFGS to a tight tolerance and reports bootstrap intervals (``bootstrap.py``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from kiln.recipes.scaling.solver import (
    BOUNDS,
    HUBER_DELTA,
    grid_scores,
    objective,
    refit,
)

FORMS = ("chinchilla", "params", "compute")
# The paper's grid of initialisations (approach 3): alpha, beta in 0..2, e in -1..1, a, b in 0..25.
GRID_EXPONENT = np.arange(0.0, 2.01, 0.5)
GRID_E = np.arange(-1.0, 1.01, 0.5)
GRID_AB = np.arange(0.0, 25.1, 5.0)
class FitError(ValueError):
    """A ladder that cannot be fitted (too few points, no spread, a non-finite loss)."""


@dataclass(frozen=True)
class Law:
    """A fitted law. ``B`` and ``beta`` are NaN for the one-variable forms."""

    form: str
    E: float
    A: float
    alpha: float
    B: float = math.nan
    beta: float = math.nan
    objective: float = math.nan  # the Huber objective at the optimum (sum over points)
    at_bound: tuple[str, ...] = field(default=())

    def predict(self, x: np.ndarray, d: np.ndarray | None = None) -> np.ndarray:
        """Loss at ``x`` (N or C by form) and, for the chinchilla form, ``d`` tokens."""
        x = np.asarray(x, dtype=np.float64)
        out = self.E + self.A / x**self.alpha
        if self.form == "chinchilla":
            if d is None:
                raise ValueError("the chinchilla form predicts from params and tokens")
            out = out + self.B / np.asarray(d, dtype=np.float64) ** self.beta
        return out

    def optimal_loss(self, compute: np.ndarray, flops_per_param_token: float = 6.0) -> np.ndarray:
        """The chinchilla form's loss at the compute-optimal split of ``compute`` FLOPs
        (C = k N D, k = ``flops_per_param_token``): N_opt = G (C / k)**(beta / (alpha + beta)),
        G = (alpha A / (beta B))**(1 / (alpha + beta)) (Hoffmann et al., appendix D.2)."""
        if self.form != "chinchilla":
            raise ValueError("optimal_loss needs the chinchilla form")
        c = np.asarray(compute, dtype=np.float64) / flops_per_param_token
        s = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / s)
        n = g * c ** (self.beta / s)
        return self.predict(n, c / n)

    def params(self) -> dict[str, float]:
        names = ("E", "A", "alpha", "B", "beta") if self.form == "chinchilla" else ("E", "A",
                                                                                     "alpha")
        return {k: getattr(self, k) for k in names}


def grid(form: str) -> np.ndarray:
    """The paper's starting points, (S, 3 or 5) in the order (e, a, alpha[, b, beta])."""
    axes = [GRID_E, GRID_AB, GRID_EXPONENT]
    if form == "chinchilla":
        axes += [GRID_AB, GRID_EXPONENT]
    return np.array(list(itertools.product(*axes)))


def check_points(form: str, x: np.ndarray, d: np.ndarray | None, loss: np.ndarray) -> None:
    """One clear FitError for input no fit should be drawn from."""
    n_params = 5 if form == "chinchilla" else 3
    what = "parameters" if form in ("chinchilla", "params") else "FLOPs"
    if len(loss) < n_params + 1:
        raise FitError(f"{len(loss)} points for the {form} form's {n_params} parameters: a fit "
                       f"needs at least {n_params + 1} (more sizes, or the one-variable form "
                       "--form params / compute)")
    bad = [i for i, v in enumerate(loss) if not (math.isfinite(v) and v > 0)]
    if bad:
        raise FitError(f"point {bad[0] + 1} has loss {loss[bad[0]]}: a diverged or unfinished "
                       "run; drop it from the ladder (a fit through it would be meaningless)")
    if np.any(~np.isfinite(x)) or np.any(x <= 0):
        raise FitError(f"every point needs a positive number of {what}")
    if len(np.unique(x)) < 2:
        raise FitError(f"every point has the same number of {what} ({x[0]:.4g}): one size "
                       "cannot fix an exponent; run at least three sizes")
    if d is not None:
        if np.any(~np.isfinite(d)) or np.any(d <= 0):
            raise FitError("every point needs a positive number of tokens")
        if len(np.unique(d)) < 2:
            raise FitError(f"every point has the same number of tokens ({d[0]:.4g}): the "
                           "chinchilla form cannot separate A/N^alpha from B/D^beta; fit "
                           "--form params, or vary the token budget")


def fit(form: str, x, loss, d=None, *, starts: int = 32, delta: float = HUBER_DELTA) -> Law:
    """Fit ``form`` to points (x = N or C, d = tokens for chinchilla, loss); see the module."""
    from scipy.optimize import minimize

    if form not in FORMS:
        raise FitError(f"unknown form {form!r}; forms: {', '.join(FORMS)}")
    x = np.asarray(x, dtype=np.float64)
    loss = np.asarray(loss, dtype=np.float64)
    d = None if form != "chinchilla" else np.asarray(d, dtype=np.float64)
    check_points(form, x, d, loss)
    logx, logl = np.log(x), np.log(loss)
    logd = None if d is None else np.log(d)
    candidates = grid(form)
    ranked = candidates[np.argsort(grid_scores(candidates, logx, logd, logl, delta))[:starts]]
    rows = refit(ranked, logx, logd, np.broadcast_to(logl, (len(ranked), len(logl))),
                 np.ones((len(ranked), len(logl))), delta=delta, iters=60)
    values = [objective(r, logx, logd, logl, delta)[0] for r in rows]
    start = rows[int(np.argmin(values))]
    names = ["e", "a", "alpha"] + (["b", "beta"] if d is not None else [])
    bounds = [BOUNDS[n] for n in names]
    best = minimize(objective, start, args=(logx, logd, logl, delta), jac=True,
                    method="L-BFGS-B", bounds=bounds,
                    options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12})
    if best.fun > min(values):  # L-BFGS only polishes: never a worse point than it started at
        best.x, best.fun = start, min(values)
    theta = best.x
    edge = tuple(n for n, v, (lo, hi) in zip(names, theta, bounds, strict=True)
                 if n in ("alpha", "beta") and (v <= lo + 1e-6 or v >= hi - 1e-6))
    law = Law(form, E=math.exp(theta[0]), A=math.exp(theta[1]), alpha=float(theta[2]),
              objective=float(best.fun), at_bound=edge)
    if d is not None:
        law = Law(form, law.E, law.A, law.alpha, B=math.exp(theta[3]), beta=float(theta[4]),
                  objective=law.objective, at_bound=edge)
    return law


def theta_of(law: Law) -> np.ndarray:
    """The log-space parameter vector of ``law`` (a warm start for a refit)."""
    out = [math.log(law.E), math.log(law.A), law.alpha]
    if law.form == "chinchilla":
        out += [math.log(law.B), law.beta]
    return np.asarray(out)

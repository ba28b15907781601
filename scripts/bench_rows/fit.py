"""Scaling-law fit with bootstrap intervals: ``kiln fit``'s code on a 20-point ladder (5 sizes x
4 tokens-per-parameter ratios from Hoffmann et al.'s law, 1% noise), the Chinchilla form with
1,000 residual-bootstrap refits, against the same fit and resamples refitted one L-BFGS call at a
time (scipy, from the full ladder's fit: what a replication script does). Seconds for the whole
fit; both sides' alpha intervals are printed, so a faster side that lands elsewhere shows.
"""

from __future__ import annotations

import time

import numpy as np

HOFFMANN = (1.69, 406.4, 410.7, 0.34, 0.28)


def _ladder():
    e, a, b, alpha, beta = HOFFMANN
    n = np.repeat(np.logspace(7.5, 9.5, 5), 4)
    d = n * np.tile([5.0, 10.0, 20.0, 40.0], 5)
    loss = (e + a / n**alpha + b / d**beta) * np.exp(np.random.default_rng(0).normal(0, .01, 20))
    return n, d, loss


def kiln(p: dict) -> dict:
    from kiln.recipes.scaling import bootstrap, laws

    n, d, loss = _ladder()
    start = time.perf_counter()
    law = laws.fit("chinchilla", n, loss, d)
    samples = bootstrap.draw(law, n, loss, d, n=p["resamples"], seed=0)
    seconds = time.perf_counter() - start
    lo, hi = samples.param_intervals()["alpha"]
    return {"seconds": seconds, "alpha": law.alpha, "alpha_interval": [lo, hi]}


def peer(p: dict) -> dict:
    from scipy.optimize import minimize

    from kiln.recipes.scaling import laws, solver

    n, d, loss = _ladder()
    start = time.perf_counter()
    law = laws.fit("chinchilla", n, loss, d)
    logs = np.log(n), np.log(d), np.log(loss)
    theta0 = laws.theta_of(law)
    fitted = np.log(np.exp(solver.terms(theta0[None, :], logs[0], logs[1])[0]).sum(axis=1))
    resid = (logs[2] - fitted) * np.sqrt(20 / 15)
    rng = np.random.default_rng(0)
    bounds = [solver.BOUNDS[k] for k in ("e", "a", "alpha", "b", "beta")]
    alphas = []
    for _ in range(p["resamples"]):
        y = fitted + resid[rng.integers(0, 20, size=20)]
        res = minimize(solver.objective, theta0, args=(logs[0], logs[1], y), jac=True,
                       method="L-BFGS-B", bounds=bounds,
                       options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12})
        alphas.append(res.x[2])
    seconds = time.perf_counter() - start
    lo, hi = np.percentile(alphas, [2.5, 97.5])
    return {"seconds": seconds, "alpha": law.alpha, "alpha_interval": [float(lo), float(hi)]}

"""Bootstrap refits: the batched solver lands where scipy's L-BFGS lands on the same resample,
whatever other resamples share its batch, draws are reproducible, and the intervals cover the
true exponents at about their nominal rate (a slow test; scripts/scaling_coverage.py prints the
full table)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.optimize import minimize

from kiln.recipes.scaling import bootstrap, laws, solver
from tests.recipes.scaling.ladders import BESIROGLU, HOFFMANN, ladder


def test_batched_refits_equal_scipy_on_the_same_resamples():
    n, d, loss = ladder(BESIROGLU, sigma=0.01, seed=4)
    law = laws.fit("chinchilla", n, loss, d)
    logs = np.log(n), np.log(d), np.log(loss)
    counts = bootstrap._case_counts(np.random.default_rng(1), 4, *logs[:2])
    theta = solver.refit(laws.theta_of(law), *logs[:2],
                            np.broadcast_to(logs[2], (4, len(n))), counts)
    bounds = [solver.BOUNDS[k] for k in ("e", "a", "alpha", "b", "beta")]
    for row, c in zip(theta, counts, strict=True):
        keep = np.repeat(np.arange(len(n)), c.astype(int))  # a point drawn twice counts twice
        ref = minimize(solver.objective, laws.theta_of(law),
                       args=(logs[0][keep], logs[1][keep], logs[2][keep]), jac=True,
                       method="L-BFGS-B", bounds=bounds,
                       options={"maxiter": 5000, "ftol": 1e-15, "gtol": 1e-12})
        ours = solver.objective(row, logs[0][keep], logs[1][keep], logs[2][keep])[0]
        assert ours <= ref.fun * (1 + 1e-6)
        np.testing.assert_allclose(row, ref.x, rtol=1e-3, atol=1e-4)


def test_a_refit_does_not_depend_on_the_rows_beside_it():
    """Each resample leaves the batch when it has converged, so its answer and its iterations
    are its own: refitted alone, in a batch, or beside a resample that needs every iteration
    (one far from the start), it lands on the same parameters."""
    n, d, loss = ladder(HOFFMANN, sigma=0.01, seed=5)
    law = laws.fit("chinchilla", n, loss, d)
    logs = np.log(n), np.log(d), np.log(loss)
    counts = bootstrap._case_counts(np.random.default_rng(2), 12, *logs[:2])
    logl = np.broadcast_to(logs[2], counts.shape)
    theta0 = laws.theta_of(law)
    together = solver.refit(theta0, *logs[:2], logl, counts)
    for i in range(len(counts)):
        alone = solver.refit(theta0, *logs[:2], logl[i:i + 1], counts[i:i + 1])
        np.testing.assert_allclose(alone[0], together[i], rtol=1e-12, atol=1e-12)
    # 30% noise: B runs onto its bound and the row still moves after 100 iterations
    noisy = logs[2] + np.random.default_rng(0).normal(0, 0.3, len(n))
    beside = solver.refit(theta0, *logs[:2], np.concatenate([logl[:3], noisy[None]]),
                          np.concatenate([counts[:3], np.ones((1, len(n)))]))
    np.testing.assert_allclose(beside[:3], together[:3], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("scheme", bootstrap.SCHEMES)
def test_draws_are_reproducible_and_bracket_the_fit(scheme):
    n, d, loss = ladder(HOFFMANN, sigma=0.01, seed=2)
    law = laws.fit("chinchilla", n, loss, d)
    a = bootstrap.draw(law, n, loss, d, n=64, seed=3, scheme=scheme)
    b = bootstrap.draw(law, n, loss, d, n=64, seed=3, scheme=scheme)
    np.testing.assert_array_equal(a.theta, b.theta)
    bands = a.param_intervals()
    assert set(bands) == {"E", "A", "alpha", "B", "beta"}
    for name in ("E", "alpha", "beta"):
        lo, hi = bands[name]
        assert lo < getattr(law, name) < hi, name
    pred = a.predictions([1e9], [2e10])
    assert pred.shape == (64, 1) and np.all(np.isfinite(pred))


def test_one_variable_form_and_no_refits():
    x = np.logspace(6, 10, 8)
    loss = (1.8 + 300.0 / x**0.3) * np.exp(np.random.default_rng(0).normal(0, 0.01, 8))
    law = laws.fit("params", x, loss)
    s = bootstrap.draw(law, x, loss, n=200, seed=0)
    lo, hi = s.param_intervals()["alpha"]
    assert lo < law.alpha < hi and set(s.param_intervals()) == {"E", "A", "alpha"}
    assert bootstrap.draw(law, x, loss, n=0).theta.shape == (0, 3)


@pytest.mark.slow
@pytest.mark.parametrize("scheme", bootstrap.SCHEMES)
def test_intervals_cover_the_true_exponents_near_their_nominal_rate(scheme):
    # 90% intervals over 30 noisy Hoffmann ladders: the binomial spread of the hit rate is
    # ~0.055, so a rate under 0.75 means the intervals are too narrow, not bad luck.
    hits = np.zeros(2)
    trials = 30
    for seed in range(trials):
        n, d, loss = ladder(HOFFMANN, sigma=0.01, seed=100 + seed)
        law = laws.fit("chinchilla", n, loss, d)
        bands = bootstrap.draw(law, n, loss, d, n=100, seed=seed, level=0.9,
                               scheme=scheme).param_intervals()
        hits += [bands["alpha"][0] <= HOFFMANN[3] <= bands["alpha"][1],
                 bands["beta"][0] <= HOFFMANN[4] <= bands["beta"][1]]
    assert np.all(hits / trials >= 0.75), hits / trials

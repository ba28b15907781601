"""The Chinchilla fit (approach 3): exact on noise-free published laws, within stated
tolerances with noise, the one-variable forms, its gradient, and one clear error for input no
fit should come from."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.recipes.scaling import laws, solver
from tests.recipes.scaling.ladders import BESIROGLU, HOFFMANN, ladder

NAMES = ("E", "A", "B", "alpha", "beta")


@pytest.mark.parametrize("law", [HOFFMANN, BESIROGLU], ids=["hoffmann", "besiroglu"])
def test_noise_free_points_give_back_the_published_law(law):
    n, d, loss = ladder(law)
    fitted = laws.fit("chinchilla", n, loss, d)
    for name, true in zip(NAMES, law, strict=True):
        assert getattr(fitted, name) == pytest.approx(true, rel=1e-4), name
    assert fitted.at_bound == ()


@pytest.mark.parametrize("law", [HOFFMANN, BESIROGLU], ids=["hoffmann", "besiroglu"])
def test_noisy_points_give_the_exponents_within_tolerance(law):
    # 1% log-normal noise on 20 points (5 sizes x 4 ratios): the estimator's spread measured
    # over 60 ladders was 0.06 (alpha) and 0.03 (beta) rms; the tolerance is about twice that.
    for seed in range(3):
        n, d, loss = ladder(law, sigma=0.01, seed=seed)
        fitted = laws.fit("chinchilla", n, loss, d)
        assert abs(fitted.alpha - law[3]) < 0.12 and abs(fitted.beta - law[4]) < 0.07, seed
        assert abs(fitted.E - law[0]) < 0.15


def test_one_variable_forms():
    n = np.logspace(6, 10, 8)
    loss = 1.8 + 300.0 / n**0.3
    fitted = laws.fit("params", n, loss)
    assert (fitted.E, fitted.A, fitted.alpha) == pytest.approx((1.8, 300.0, 0.3), rel=1e-4)
    assert math.isnan(fitted.beta) and set(fitted.params()) == {"E", "A", "alpha"}
    c = np.logspace(17, 23, 7)
    fitted = laws.fit("compute", c, 2.0 + 1e3 / c**0.15)
    assert (fitted.E, fitted.alpha) == pytest.approx((2.0, 0.15), rel=1e-4)


def test_the_gradient_is_the_objectives():
    n, d, loss = ladder(HOFFMANN, sigma=0.01)
    args = (np.log(n), np.log(d), np.log(loss))
    theta = np.array([0.4, 6.2, 0.36, 5.8, 0.27])
    _, grad = solver.objective(theta, *args)
    for i in range(5):
        step = np.zeros(5)
        step[i] = 1e-7
        numeric = (solver.objective(theta + step, *args)[0]
                   - solver.objective(theta - step, *args)[0]) / 2e-7
        assert grad[i] == pytest.approx(numeric, rel=1e-4, abs=1e-10)


def test_the_compute_optimal_loss_is_the_best_split():
    law = laws.Law("chinchilla", *HOFFMANN[:2], alpha=HOFFMANN[3], B=HOFFMANN[2],
                   beta=HOFFMANN[4])
    c = 1e21
    ns = np.logspace(8, 11, 3001)
    brute = law.predict(ns, c / (6 * ns)).min()
    assert law.optimal_loss(np.array([c]))[0] == pytest.approx(brute, rel=1e-6)


@pytest.mark.parametrize("case, message", [
    ("few", "at least 6"), ("one size", "same number of parameters"),
    ("nan", "diverged or unfinished"), ("one budget", "same number of tokens"),
    ("zero", "positive number of parameters"),
])
def test_degenerate_ladders_get_one_clear_line(case, message):
    n, d, loss = ladder(HOFFMANN)
    if case == "few":
        n, d, loss = n[:5], d[:5], loss[:5]
    elif case == "one size":
        n = np.full_like(n, 1e8)
    elif case == "nan":
        loss[3] = math.nan
    elif case == "one budget":
        d = np.full_like(d, 1e10)
    elif case == "zero":
        n[0] = 0
    with pytest.raises(laws.FitError, match=message):
        laws.fit("chinchilla", n, loss, d)
    with pytest.raises(laws.FitError, match="unknown form"):
        laws.fit("kaplan", n, loss, d)

"""Is one run's score better than another's beyond noise? The tests ``kiln compare`` and the
sweep summary use.

Two runs scored on the same examples (the same task fingerprint, or the same held-out batches)
are compared example by example: a paired t-test on the per-example differences, which removes
the examples' own difficulty from the noise (the usual test for two models on one benchmark).
Otherwise each score's standard error stands for its noise: a two-sided z-test on the
difference, with the two errors added in quadrature. scipy computes the p-values (written here:
which test applies and what it is fed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALPHA = 0.05  # a difference with p below this is "significant"


@dataclass(frozen=True)
class Verdict:
    p: float  # two-sided p-value of "no difference"
    how: str  # "paired t, n=32" or "z on stderr"

    @property
    def significant(self) -> bool:
        return self.p < ALPHA


def paired(a: np.ndarray, b: np.ndarray, unit: str = "") -> Verdict | None:
    """Paired t-test of per-example scores ``a`` and ``b`` (n,); None if they cannot pair.
    ``unit`` names what is paired when it is not examples ("seeds")."""
    from scipy import stats

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1 or len(a) < 2:
        return None
    how = f"paired t{' by ' + unit.rstrip('s') if unit else ''}, n={len(a)}"
    d = a - b
    if not np.any(d):  # identical scores: no evidence of any difference
        return Verdict(1.0, how)
    if np.all(d == d[0]):  # a constant shift: no spread, the difference is certain
        return Verdict(0.0, how)
    p = float(stats.ttest_rel(a, b).pvalue)
    return Verdict(p if math.isfinite(p) else 1.0, how)


def welch(a: np.ndarray, b: np.ndarray) -> Verdict | None:
    """Welch's two-sample t-test (unequal variances) of two runs' sets of scores over seeds;
    None below two values a side."""
    from scipy import stats

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if len(a) < 2 or len(b) < 2:
        return None
    how = f"Welch t over seeds, n={len(a)}/{len(b)}"
    if np.var(a) == 0 and np.var(b) == 0:
        return Verdict(1.0 if a[0] == b[0] else 0.0, how)
    p = float(stats.ttest_ind(a, b, equal_var=False).pvalue)
    return Verdict(p if math.isfinite(p) else 1.0, how)


def unpaired(a: float, se_a: float, b: float, se_b: float) -> Verdict | None:
    """Two-sided z-test of ``a - b`` from the standard errors; None without them (a NaN: one
    batch or one example, whose noise is unknown)."""
    from scipy import stats

    if not all(map(math.isfinite, (a, se_a, b, se_b))):
        return None
    spread = math.hypot(se_a, se_b)
    if spread == 0:
        return Verdict(1.0 if a == b else 0.0, "z on stderr")
    return Verdict(float(2 * stats.norm.sf(abs(a - b) / spread)), "z on stderr")


def batch_means(values: np.ndarray) -> np.ndarray:
    """Per-batch mean loss from the held-out loss's (batches, [loss_sum, tokens]) rows."""
    return values[:, 0] / np.maximum(values[:, 1], 1)


def ratio_stderr(sums: np.ndarray, counts: np.ndarray) -> float:
    """Standard error of ``sum(sums) / sum(counts)`` over K batches (the ratio estimator's
    linearisation: batches of unequal token counts weigh by their counts); NaN (unknown) for
    K < 2: one batch says nothing of the noise."""
    sums, counts = np.asarray(sums, np.float64), np.asarray(counts, np.float64)
    keep = counts > 0
    sums, counts = sums[keep], counts[keep]
    k = len(sums)
    if k < 2:
        return math.nan
    mean = sums.sum() / counts.sum()
    resid = (sums - mean * counts) / counts.sum()
    return float(math.sqrt(k / (k - 1) * float(np.sum(resid ** 2))))


def p_text(p: float) -> str:
    """``p = 0.043``, or ``p < 0.0001`` for the tiny ones."""
    return "p < 0.0001" if p < 1e-4 else f"p = {p:.2g}"

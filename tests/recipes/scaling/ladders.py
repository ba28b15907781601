"""Synthetic ladders from published laws, for the fit tests: points on a law times log-normal
noise."""

from __future__ import annotations

import numpy as np

# Hoffmann et al. 2022 (approach 3) and Besiroglu et al. 2024's replication: E, A, B, alpha, beta.
HOFFMANN = (1.69, 406.4, 410.7, 0.34, 0.28)
BESIROGLU = (1.82, 482.0, 2085.4, 0.3478, 0.3658)


def ladder(law, *, sigma: float = 0.0, seed: int = 0, sizes: int = 5,
           ratios=(5, 10, 20, 40)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``sizes`` model sizes from 30M to 3B, each at every tokens-per-parameter ratio."""
    e, a, b, alpha, beta = law
    n = np.repeat(np.logspace(7.5, 9.5, sizes), len(ratios))
    d = n * np.tile(np.asarray(ratios, dtype=np.float64), sizes)
    loss = e + a / n**alpha + b / d**beta
    return n, d, loss * np.exp(np.random.default_rng(seed).normal(0, sigma, len(n)))


def write_csv(path, n, d, loss, flops=None) -> None:
    rows = ["params,tokens,loss" + (",flops" if flops is not None else "")]
    for i in range(len(n)):
        cells = [n[i], d[i], loss[i]] + ([flops[i]] if flops is not None else [])
        rows.append(",".join(repr(float(v)) for v in cells))
    path.write_text("\n".join(rows) + "\n")

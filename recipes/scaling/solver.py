"""A batched solver for the Huber objective of ``laws.py``: many fits at once.

Levenberg-Marquardt on the iteratively reweighted least-squares form of the Huber loss: the
weights min(1, delta / |r|) make the weighted residual's gradient exactly the Huber gradient, a
step is kept only where it lowers the Huber objective, and the damping adapts per row. All
rows (bootstrap resamples, or one ladder's starting points) advance together in numpy's
batched linear algebra; scipy offers no batched nonlinear solver, and one L-BFGS call per row
costs ~25 ms here (``scripts/bench_rows/fit.py`` compares the two).
"""

from __future__ import annotations

import numpy as np

HUBER_DELTA = 1e-3  # Hoffmann et al. 2022, approach 3
# Bounds keep exp() finite and the exponents positive (a negative exponent is not a power law
# that falls); a fit that ends on a bound is reported (``Law.at_bound``).
BOUNDS = {"e": (-10.0, 5.0), "a": (-20.0, 80.0), "alpha": (0.0, 5.0), "b": (-20.0, 80.0),
          "beta": (0.0, 5.0)}



def terms(theta: np.ndarray, logx: np.ndarray, logd: np.ndarray | None) -> np.ndarray:
    """The log of each additive term for rows of parameters ``theta`` (B, K): (B, P, 2 or 3),
    [e, a - alpha log x, (b - beta log d)]."""
    cols = [np.broadcast_to(theta[:, :1], (len(theta), len(logx))),
            theta[:, 1:2] - theta[:, 2:3] * logx]
    if logd is not None:
        cols.append(theta[:, 3:4] - theta[:, 4:5] * logd)
    return np.stack(cols, axis=2)


def objective(theta: np.ndarray, logx: np.ndarray, logd: np.ndarray | None,
              logl: np.ndarray, delta: float = HUBER_DELTA) -> tuple[float, np.ndarray]:
    """Huber loss of the log-space residuals, summed over points, and its gradient."""
    t = terms(theta[None, :], logx, logd)[0]  # (P, K)
    top = t.max(axis=1, keepdims=True)
    w = np.exp(t - top)
    lse = top[:, 0] + np.log(w.sum(axis=1))
    w /= w.sum(axis=1, keepdims=True)  # d lse / d term
    r = lse - logl
    small = np.abs(r) <= delta
    loss = np.where(small, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum()
    psi = np.clip(r, -delta, delta)  # d huber / d r
    grad = [np.dot(psi, w[:, 0]), np.dot(psi, w[:, 1]), -np.dot(psi, w[:, 1] * logx)]
    if logd is not None:
        grad += [np.dot(psi, w[:, 2]), -np.dot(psi, w[:, 2] * logd)]
    return float(loss), np.asarray(grad)


def grid_scores(starts: np.ndarray, logx: np.ndarray, logd: np.ndarray | None,
                logl: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    """The objective at every starting point at once, (S,)."""
    t = terms(starts, logx, logd)  # (S, P, K)
    top = t.max(axis=2, keepdims=True)
    r = top[..., 0] + np.log(np.exp(t - top).sum(axis=2)) - logl
    return np.where(np.abs(r) <= delta, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum(1)


def _residuals(theta: np.ndarray, logx, logd, logl) -> tuple[np.ndarray, np.ndarray]:
    """Log-space residuals (B, P) and their Jacobian (B, P, K), for B parameter rows."""
    t = terms(theta, logx, logd)  # (B, P, T)
    top = t.max(axis=2, keepdims=True)
    w = np.exp(t - top)
    lse = top[..., 0] + np.log(w.sum(axis=2))
    w /= w.sum(axis=2, keepdims=True)
    jac = [w[..., 0], w[..., 1], -w[..., 1] * logx]
    if logd is not None:
        jac += [w[..., 2], -w[..., 2] * logd]
    return lse - logl, np.stack(jac, axis=2)


def _huber(r: np.ndarray, counts: np.ndarray, delta: float) -> np.ndarray:
    a = np.abs(r)
    return (counts * np.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))).sum(axis=1)


def refit(theta0: np.ndarray, logx, logd, logl: np.ndarray, counts: np.ndarray, *,
          delta: float = HUBER_DELTA, iters: int = 400) -> np.ndarray:
    """Minimise each row's weighted Huber objective from ``theta0``; (B, K) parameters.

    ``logl`` and ``counts`` are (B, P): each resample's observed log losses and point weights.
    """
    names = ["e", "a", "alpha"] + (["b", "beta"] if logd is not None else [])
    lo = np.array([BOUNDS[n][0] for n in names])
    hi = np.array([BOUNDS[n][1] for n in names])
    theta = np.array(np.broadcast_to(theta0, (len(logl), len(names))))
    r, jac = _residuals(theta, logx, logd, logl)
    f = _huber(r, counts, delta)
    damping = np.full(len(theta), 1e-3)
    eye = np.eye(len(names))
    # A row leaves the batch once an accepted step stops lowering its objective (or its
    # damping saturates); the rest iterate on without it (a thousand resamples: a fifth of the
    # time of iterating every row until all of them converge in the same iteration).
    todo = np.arange(len(theta))
    for _ in range(iters):
        rr, jj, cc, ll, dd = r[todo], jac[todo], counts[todo], logl[todo], damping[todo]
        weight = cc * np.where(np.abs(rr) <= delta, 1.0, delta / np.maximum(np.abs(rr), delta))
        grad = np.einsum("bpk,bp->bk", jj, weight * rr)  # the Huber gradient
        gn = np.matmul(jj.transpose(0, 2, 1) * weight[:, None, :], jj)  # IRLS Gauss-Newton
        diag = np.einsum("bkk->bk", gn)
        lhs = gn + (dd[:, None, None] * (diag[:, :, None] + 1e-12)) * eye + 1e-14 * eye
        step = np.linalg.solve(lhs, -grad[..., None])[..., 0]
        trial = np.clip(theta[todo] + step, lo, hi)
        r_new, jac_new = _residuals(trial, logx, logd, ll)
        f_old, f_new = f[todo], _huber(r_new, cc, delta)
        better = f_new < f_old
        keep = todo[better]
        theta[keep], r[keep], jac[keep], f[keep] = \
            trial[better], r_new[better], jac_new[better], f_new[better]
        damping[todo] = np.where(better, dd / 3, dd * 4).clip(1e-12, 1e12)
        # converged: an accepted step that no longer lowers the objective (a rejected step says
        # nothing: its damping grows until a step is accepted or the damping saturates)
        done = better & (f_old - f_new <= 1e-14 * np.maximum(f_old, 1e-30))
        todo = todo[~(done | (damping[todo] >= 1e12))]
        if not len(todo):
            break
    return theta

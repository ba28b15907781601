"""Which source each training sequence of a data mixture comes from: a pure function of
(seed, weights, global position), so every world size and micro-batch split sees the same
global batches, and small runs get the shares they asked for.

Sequence ``j`` goes to the source whose slice of [0, 1) holds ``u_j = frac(phase + j * φ)``
(φ = the golden ratio's fractional part; ``phase`` from the seed), the slices laid end to end
with lengths equal to the normalised weights. This is a Kronecker (Weyl) sequence, not i.i.d.
sampling: any window of consecutive positions is the same sequence with another phase, and the
golden ratio's sequence has the lowest discrepancy of its kind: over every window of 1,000
sequences each source's share was within 0.2% of its weight for the weights the tests use
(they check 1%). Sampled i.i.d., a 10% source is off by ~1% (one standard deviation) per
1,000 sequences.

Arithmetic is in 64-bit fixed point (numpy's uint64 wraps modulo 2**64 exactly), so position
10**12 is as exact as position 0 and every process computes the same bits.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Sequence

import numpy as np

from kiln.components.errors import RecipeError

_ONE = 1 << 64
_PHI = np.uint64(int((5 ** 0.5 - 1) / 2 * _ONE))  # frac(golden ratio) in 0.64 fixed point


def _bounds(weights: Sequence[float]) -> np.ndarray:
    """Upper ends of each source's slice of [0, 2**64), the last one 2**64 - 1 inclusive."""
    return _cached_bounds(tuple(float(x) for x in weights))


@functools.lru_cache(maxsize=64)  # a loader asks for the same stage's bounds every batch
def _cached_bounds(weights: tuple[float, ...]) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or not len(w) or not np.all(np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise RecipeError(f"mixture weights {list(weights)}: give one finite weight >= 0 per "
                          "source, not all zero")
    cum = np.cumsum(w / w.sum())
    # float64 holds 53 bits: the slice ends are exact to ~1e-16 of a share; the last is pinned
    ends = [min(int(c * _ONE), _ONE - 1) for c in cum[:-1]]
    return np.array([*ends, _ONE - 1], dtype=np.uint64)


@functools.lru_cache(maxsize=64)
def phase(seed: int, stage: int = 0) -> np.uint64:
    """The sequence's start in [0, 2**64): a fixed hash of the seed and the stage (each stage of
    a mixture starts its own sequence; Python's hash() is salted, crc32 is not)."""
    key = f"mixture:{seed}" + (f":stage{stage}" if stage else "")
    lo = zlib.crc32(key.encode())
    hi = zlib.crc32(f"{key}:hi".encode())
    return np.uint64((hi << 32) | lo)


def sources(positions: np.ndarray | Sequence[int], weights: Sequence[float],
            seed: int = 0, stage: int = 0) -> np.ndarray:
    """Source index (int64) of each sequence position (counted from the stage's start)."""
    j = np.asarray(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):  # wrapping modulo 2**64 is the point
        u = phase(seed, stage) + j * _PHI
    return np.searchsorted(_bounds(weights), u, side="left").astype(np.int64)


def counts(start: int, stop: int, weights: Sequence[float], seed: int = 0,
           stage: int = 0) -> np.ndarray:
    """How many of the positions ``[start, stop)`` each source gets (int64, one per source)."""
    n = len(weights)
    out = np.zeros(n, dtype=np.int64)
    for lo in range(start, stop, 1 << 20):  # bounded memory for long spans
        chunk = sources(np.arange(lo, min(stop, lo + (1 << 20)), dtype=np.uint64), weights, seed,
                        stage)
        out += np.bincount(chunk, minlength=n)
    return out


def rows_within(positions: np.ndarray, weights: Sequence[float], seed: int,
                before: np.ndarray, stage: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(source, row of that source) for consecutive ``positions``; ``before[i]`` is how many
    sequences source ``i`` gave before ``positions[0]`` (a loader carries it in its cursor)."""
    src = sources(positions, weights, seed, stage)
    # the k-th sequence of source i here is its row before[i] + k: a running count per source
    seen = np.cumsum(src[:, None] == np.arange(len(weights)), axis=0)  # (n, sources)
    rows = np.asarray(before, dtype=np.int64)[src] + seen[np.arange(len(src)), src] - 1
    return src, rows

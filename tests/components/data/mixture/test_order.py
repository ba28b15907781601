"""The mixture's source order: exact shares on every 1,000-sequence window, a pure function of
(seed, weights, position), the same however the positions are split among processes."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.components.data.mixture import order as mo
from kiln.components.errors import RecipeError

WEIGHTS = [[0.5, 0.3, 0.2], [0.7, 0.2, 0.1], [1, 1, 1, 1], [0.9, 0.05, 0.05], [3, 1]]


@pytest.mark.parametrize("weights", WEIGHTS, ids=str)
@pytest.mark.parametrize("seed", [0, 1, 1234])
def test_every_window_of_a_thousand_sequences_gets_each_share_within_one_percent(weights, seed):
    share = np.asarray(weights, dtype=float) / sum(weights)
    src = mo.sources(np.arange(200_000), weights, seed)
    onehot = np.eye(len(weights), dtype=np.int64)[src]
    cum = np.vstack([np.zeros(len(weights), dtype=np.int64), np.cumsum(onehot, axis=0)])
    window = (cum[1000:] - cum[:-1000]) / 1000  # every window start, not only aligned ones
    worst = np.abs(window - share).max()
    assert worst <= 0.01, worst
    # far positions are as exact: the fixed-point arithmetic does not lose bits
    far = mo.counts(10**12, 10**12 + 1000, weights, seed) / 1000
    assert np.abs(far - share).max() <= 0.01


def test_iid_sampling_would_miss_the_bound_which_is_why_the_order_is_not_random():
    rng = np.random.default_rng(0)
    draws = rng.choice(3, size=(500, 1000), p=[0.7, 0.2, 0.1])
    worst = max(abs((d == 2).mean() - 0.1) for d in draws)
    assert worst > 0.01  # the bound above is a property of the order, not a loose test


def test_the_order_is_a_pure_function_however_positions_are_split():
    weights, seed = [0.5, 0.3, 0.2], 7
    whole = mo.sources(np.arange(4096), weights, seed)
    for world in (1, 2, 4):
        per_rank = [mo.sources(np.arange(r * 4096 // world, (r + 1) * 4096 // world),
                               weights, seed) for r in range(world)]
        assert np.array_equal(np.concatenate(per_rank), whole)
    assert not np.array_equal(mo.sources(np.arange(4096), weights, seed + 1), whole)


def test_rows_continue_from_the_counts_before_a_position():
    weights, seed = [0.6, 0.4], 3
    src_all, rows_all = mo.rows_within(np.arange(300), weights, seed, np.zeros(2, np.int64))
    before = mo.counts(0, 120, weights, seed)
    src, rows = mo.rows_within(np.arange(120, 300), weights, seed, before)
    assert np.array_equal(src, src_all[120:]) and np.array_equal(rows, rows_all[120:])
    for i in range(2):  # each source's rows are 0, 1, 2, ... in position order
        assert list(rows_all[src_all == i]) == list(range(int((src_all == i).sum())))


def test_a_zero_weight_source_gets_nothing_and_bad_weights_are_one_error():
    src = mo.sources(np.arange(10_000), [1, 0, 1], 0)
    assert 1 not in set(src.tolist()) and {0, 2} <= set(src.tolist())
    for bad in ([], [0, 0], [1, -1], [1, float("nan")]):
        with pytest.raises(RecipeError, match="mixture weights"):
            mo.sources(np.arange(3), bad, 0)

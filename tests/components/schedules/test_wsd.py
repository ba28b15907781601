"""Warmup-stable-decay: values at known steps for each decay shape."""

from __future__ import annotations

import math

import pytest

from kiln.components.base import default_config


def _sched(total: int = 100, **values):
    return default_config("schedule", "wsd", **values).build(total_steps=total)


@pytest.mark.parametrize(
    "shape, left",
    [("linear", lambda t: 1 - t), ("cosine", lambda t: 0.5 * (1 + math.cos(math.pi * t))),
     ("sqrt", lambda t: 1 - math.sqrt(t))],
)
def test_phases(shape, left):
    s = _sched(warmup_steps=10, decay_fraction=0.2, decay_shape=shape, min_lr_ratio=0.1)
    assert s(0) == pytest.approx(0.1)
    assert s(9) == pytest.approx(1.0)
    assert s(10) == s(50) == s(79) == 1.0  # stable phase
    for step in (80, 85, 99):  # decay over the last 20 steps, t = (step - 80 + 1) / 20
        t = (step - 79) / 20
        assert s(step) == pytest.approx(0.1 + 0.9 * left(t))
    assert s(99) == pytest.approx(0.1)
    assert s(1000) == pytest.approx(0.1)


def test_no_decay_phase_holds_the_peak():
    s = _sched(warmup_fraction=0.1, decay_fraction=0.0)
    assert s.warmup == 10
    assert s(99) == 1.0 and s(10) == 1.0


def test_decay_starts_no_earlier_than_the_end_of_warmup():
    """Issue 10 item 5: with warmup + decay longer than the run, the decay began inside the
    warmup and the LR jumped from the peak to 78% at the end of the warmup. The reference
    starts the decay at max(T - D, W)."""
    s = _sched(total=100, warmup_steps=60, decay_fraction=0.5, min_lr_ratio=0.0)
    values = [s(k) for k in range(100)]
    assert values[59] == 1.0 and s.decay_start == 60 and s.decay == 40
    assert values[60] == pytest.approx(1 - 1 / 40)
    assert max(abs(b - a) for a, b in zip(values, values[1:], strict=False)) <= 1 / 40 + 1e-12
    assert values[99] == pytest.approx(0.0)
    whole = _sched(total=10, warmup_steps=10, decay_fraction=0.5)  # warmup is the whole run
    assert [whole(k) for k in range(10)] == pytest.approx([(k + 1) / 10 for k in range(10)])

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

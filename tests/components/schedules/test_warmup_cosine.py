"""Warmup-cosine: linear warmup, cosine to the floor, values at known steps."""

from __future__ import annotations

import math

import pytest

from kiln.components.base import default_config


def _sched(total: int = 110, **values):
    return default_config("schedule", "warmup_cosine", **values).build(total_steps=total)


def test_values_at_known_steps():
    s = _sched(warmup_steps=10, min_lr_ratio=0.1)
    assert s(0) == pytest.approx(0.1)  # (step + 1) / warmup
    assert s(4) == pytest.approx(0.5)
    assert s(9) == pytest.approx(1.0)
    assert s(10) == pytest.approx(1.0)  # decay starts at the peak
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    assert s(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.25)))
    assert s(110) == pytest.approx(0.1)
    assert s(500) == pytest.approx(0.1)  # clamped after the end


def test_monotone_after_warmup_and_warmup_fraction():
    s = _sched(total=200, warmup_fraction=0.05, min_lr_ratio=0.0)
    assert s.warmup == 10
    values = [s(i) for i in range(10, 201)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
    assert values[-1] == pytest.approx(0.0)


def test_reference_cosine_matches():
    # The 10B reference: peak*(step+1)/warmup, then floor + (peak-floor)/2 (1 + cos(pi t)).
    peak, floor, warmup, total = 6e-3, 6e-4, 40, 1300
    s = _sched(total=total, warmup_steps=warmup, min_lr_ratio=floor / peak)
    for step in (0, 17, 39, 40, 500, 1299):
        if step < warmup:
            ref = peak * (step + 1) / warmup
        else:
            t = (step - warmup) / (total - warmup)
            ref = floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * t))
        assert peak * s(step) == pytest.approx(ref)

"""Constant schedule: optional linear warmup, then the peak."""

from __future__ import annotations

import pytest

from kiln.components.base import default_config


def test_constant_with_and_without_warmup():
    plain = default_config("schedule", "constant").build(total_steps=10)
    assert [plain(i) for i in (0, 5, 100)] == [1.0, 1.0, 1.0]
    warm = default_config("schedule", "constant", warmup_steps=4).build(total_steps=10)
    assert [warm(i) for i in range(6)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])

"""Batch plan and training budget: derived accumulation and clear errors."""

from __future__ import annotations

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.config.schema import TrainingConfig
from kiln.recipes.preflight.batch_plan import plan, total_steps


def test_grad_accum_is_derived():
    bp = plan(TrainingConfig(global_batch=32, micro_batch=4, seq_len=16), world_size=2)
    assert (bp.grad_accum, bp.tokens_per_step) == (4, 512)


def test_explicit_grad_accum_is_checked():
    assert plan(TrainingConfig(global_batch=8, micro_batch=2, grad_accum=4), 1).grad_accum == 4
    with pytest.raises(RecipeError, match=r"micro_batch \(2\) x training.grad_accum \(3\)"):
        plan(TrainingConfig(global_batch=8, micro_batch=2, grad_accum=3), 1)


@pytest.mark.parametrize("gb,mb,world,match", [
    (9, 1, 2, "not divisible by the world size 2"),
    (8, 3, 1, "not divisible by training.micro_batch = 3"),
])
def test_indivisible_batches(gb, mb, world, match):
    with pytest.raises(RecipeError, match=match):
        plan(TrainingConfig(global_batch=gb, micro_batch=mb), world)


def test_budget_by_steps_epochs_tokens():
    bp = plan(TrainingConfig(global_batch=4, micro_batch=4, seq_len=10), 1)
    assert total_steps(TrainingConfig(steps=7), bp, 100) == 7
    assert total_steps(TrainingConfig(epochs=1.5), bp, 100) == 150
    assert total_steps(TrainingConfig(tokens=401, seq_len=10), bp, None) == 11
    with pytest.raises(RecipeError, match="no training budget"):
        total_steps(TrainingConfig(), bp, 100)


def test_min_steps_floors_a_derived_budget_only():
    bp = plan(TrainingConfig(global_batch=4, micro_batch=4, seq_len=10), 1)
    assert total_steps(TrainingConfig(tokens=401, min_steps=20), bp, None) == 20
    assert total_steps(TrainingConfig(tokens=4000, min_steps=20), bp, None) == 100
    assert total_steps(TrainingConfig(epochs=0.1, min_steps=20), bp, 100) == 20
    assert total_steps(TrainingConfig(steps=7, min_steps=20), bp, None) == 7  # steps win

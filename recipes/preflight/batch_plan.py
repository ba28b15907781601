"""The batch plan (global batch, micro-batch, gradient accumulation) and the training budget."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.components.errors import RecipeError


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int  # sequences per optimizer step, all ranks
    micro_batch: int  # sequences per forward pass, one rank
    grad_accum: int  # micro-batches per step, one rank
    world_size: int
    seq_len: int

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


def plan(training, world_size: int, tp: int = 1, cp: int = 1) -> BatchPlan:
    """Derive (or check) gradient accumulation; errors say which numbers do not divide.

    ``world_size`` is the number of data-parallel ranks: the world size / (``cp`` x ``tp``)
    (context- and tensor-parallel peers share their batch)."""
    gb, mb, acc = training.global_batch, training.micro_batch, training.grad_accum
    if gb % world_size:
        inner = " x ".join(f"parallelism.{k} {v}" for k, v in (("cp", cp), ("tp", tp)) if v > 1)
        what = (f"the data-parallel size {world_size} (world size / {inner})"
                if inner else f"the world size {world_size}")
        raise RecipeError(
            f"training.global_batch = {gb} is not divisible by {what}; "
            f"use a multiple of {world_size}"
        )
    per_rank = gb // world_size
    if acc == 0:
        if per_rank % mb:
            raise RecipeError(
                f"training.global_batch / world size = {per_rank} sequences per rank is not "
                f"divisible by training.micro_batch = {mb}; pick micro_batch dividing {per_rank}"
            )
        acc = per_rank // mb
    elif mb * acc != per_rank:
        raise RecipeError(
            f"training.micro_batch ({mb}) x training.grad_accum ({acc}) = {mb * acc}, but "
            f"global_batch / world size = {per_rank}; set grad_accum = 0 to derive it"
        )
    return BatchPlan(gb, mb, acc, world_size, training.seq_len)


def total_steps(training, bp: BatchPlan, steps_per_epoch: int | None) -> int:
    """Budget by steps, else epochs of the data, else tokens (these two at least
    ``min_steps``: the 10B reference trains max(130k steps, 200B tokens))."""
    if training.steps:
        return training.steps
    if training.epochs:
        if not steps_per_epoch:
            raise RecipeError("training.epochs needs a dataset that knows its epoch length")
        return max(1, training.min_steps, math.floor(training.epochs * steps_per_epoch))
    if training.tokens:
        return max(1, training.min_steps, math.ceil(training.tokens / bp.tokens_per_step))
    raise RecipeError("no training budget: set training.steps, training.epochs or training.tokens")


def describe_budget(training, bp: BatchPlan) -> str:
    """One line for ``kiln validate``: steps and tokens the budget comes to (epochs: later)."""
    if not training.steps and training.epochs:
        return (f"budget: {training.epochs:g} epochs of the data (steps known once it is "
                f"prepared), {bp.tokens_per_step:,} tokens/step")
    steps = total_steps(training, bp, None)
    tokens = steps * bp.tokens_per_step
    billions = f" ({tokens / 1e9:.1f}B)" if tokens >= 1e9 else ""
    return (f"budget: {steps:,} steps x {bp.tokens_per_step:,} tokens/step = {tokens:,} "
            f"tokens{billions} (world size {bp.world_size})")

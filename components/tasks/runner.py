"""Running a planned task on data-parallel ranks: batch i goes to rank ``i % world_size``, each
batch's per-unit values land in their rows of one table, and a sum over ranks (every row written
by exactly one rank, zeros elsewhere) gives every rank the same table, so the metrics equal a
one-process run's. Ranks with fewer batches score a spare one and drop it: under FSDP every
forward gathers weights with all ranks, so all make the same number of forwards."""

from __future__ import annotations

import torch

from kiln.components import distributed
from kiln.components.tasks.common import Plan


def run(task, plan: Plan, scorer, *, rank: int = 0, world_size: int = 1) -> dict[str, float]:
    """The task's metrics over all ranks' batches (every rank gets them)."""
    return task.summarize(score(task, plan, scorer, rank=rank, world_size=world_size))


def score(task, plan: Plan, scorer, *, rank: int = 0, world_size: int = 1) -> torch.Tensor:
    """Every unit's values (units, columns), the same on all ranks: what ``summarize`` turns
    into metrics, and what a paired comparison of two runs reads."""
    values = torch.zeros(plan.units, len(plan.columns), dtype=torch.float64)
    mine = plan.batches[rank::world_size]
    rounds = -(-len(plan.batches) // world_size)
    for i in range(rounds):
        if i < len(mine):
            values[mine[i].units] = task.score(scorer, mine[i])
        else:
            task.score(scorer, plan.batches[-1])  # in step with the others; result dropped
    if world_size > 1:
        distributed.all_reduce_(values)
    return values

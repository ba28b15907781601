"""torch.distributed.pipelining schedules: building them, checking a micro-batch count against
one, and the bubble fraction of its timetable.

The checks and the bubble come from torch's own schedule objects, built on stand-in stages (no
process group): the same constructor that refuses a count at train time refuses it in ``kiln
validate``, and the bubble is read from the exact per-rank action lists torch will run. The
timetable is simulated with forward = 1, full backward = 2, and input / weight backward = 1 each
(the usual cost model of the zero-bubble papers; transfers free): each rank runs its actions in
order, each as soon as the actions it depends on (previous stage's forward, next stage's
backward) are done. The bubble is the idle share of ``ranks x makespan``.
"""

from __future__ import annotations

import importlib
import re

import torch
from torch import nn

from kiln.parallelisms.pipeline.split import SCHEDULES, num_stages, rank_stages

COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def schedule_class(name: str) -> type:
    module = importlib.import_module("torch.distributed.pipelining.schedules")
    return getattr(module, SCHEDULES[name][0])


class _StandIn:
    """What a schedule's constructor reads of a stage (no communication, no module)."""

    def __init__(self, index: int, n_stages: int, pp: int, rank: int) -> None:
        self.stage_index, self.num_stages = index, n_stages
        self.group_size, self.group_rank = pp, rank
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = nn.Identity()


def stand_in(cfg, n_microbatches: int, pp_rank: int = 0):
    """The schedule object of ``cfg`` for ``n_microbatches`` on stand-in stages (raises
    torch's ValueError when the count does not suit the schedule)."""
    cls = schedule_class(cfg.pp_schedule)
    n = num_stages(cfg)
    stages = [_StandIn(s, n, cfg.pp, pp_rank) for s in rank_stages(cfg, pp_rank)]
    if SCHEDULES[cfg.pp_schedule][1] == "single":
        return cls(stages[0], n_microbatches)
    return cls(stages, n_microbatches)


def microbatch_problem(cfg, n_microbatches: int) -> str | None:
    """Why ``n_microbatches`` per run cannot drive the schedule (None: it can)."""
    n = num_stages(cfg)
    if SCHEDULES[cfg.pp_schedule][1] != "single" and n_microbatches < cfg.pp:
        reason = f"interleaved schedules need at least pp = {cfg.pp}"
    else:
        try:
            stand_in(cfg, n_microbatches)
            return None
        except ValueError as exc:
            reason = " ".join(str(exc).split())
    return (f"pp_schedule = \"{cfg.pp_schedule}\" with {n} stages cannot run "
            f"{n_microbatches} micro-batches per pipeline run ({reason}); give each "
            "data-parallel rank more micro-batches per step (lower training.micro_batch or raise "
            "training.global_batch), or run more of them at once (parallelism.pp_microbatches)")


_ACTION = re.compile(r"^(\d+)(F|B|I|W)(\d+)$")


def _compute_ops(action) -> list[tuple[str, int, int]]:
    """(kind, stage, micro-batch) of the compute in one action (an overlapped F;B gives both)."""
    if action is None:
        return []
    ops = []
    for part in re.split(r"[();]", str(action).replace("OVERLAP_F_B", "")):
        m = _ACTION.match(part)
        if m:
            ops.append((m.group(2), int(m.group(1)), int(m.group(3))))
    return ops


def _ready(kind: str, stage: int, mb: int, done: dict, n_stages: int) -> float | None:
    """When the dependencies of one op are done (None: not yet)."""
    deps = []
    if kind == "F":
        deps = [("F", stage - 1, mb)] if stage > 0 else []
    elif kind in ("B", "I"):
        deps = [("F", stage, mb)]
        if stage < n_stages - 1:
            deps.append(("BI", stage + 1, mb))
    else:  # W
        deps = [("I", stage, mb)]
    times = []
    for dk, ds, dm in deps:
        keys = [("B", ds, dm), ("I", ds, dm)] if dk == "BI" else [(dk, ds, dm)]
        found = [done[k] for k in keys if k in done]
        if not found:
            return None
        times.append(min(found))
    return max(times, default=0.0)


def _single_stage_ops(name: str, stage: int, n_stages: int, n: int) -> list[tuple]:
    """What ``ScheduleGPipe`` / ``Schedule1F1B`` run on ``stage`` (their ``_step_microbatches``;
    the action lists they publish are for display and do not match it)."""
    if name == "gpipe":
        return [("F", stage, m) for m in range(n)] + [("B", stage, m) for m in range(n)]
    warmup = min(n, n_stages - stage)
    ops = [("F", stage, m) for m in range(warmup)]
    f, b = warmup, 0
    while b < n:
        ops.append(("B", stage, b))
        b += 1
        if f < n:
            ops.append(("F", stage, f))
            f += 1
    return ops


def bubble_fraction(cfg, n_microbatches: int) -> float:
    """Idle share of the schedule's timetable for ``n_microbatches`` per run (0 .. 1)."""
    n_stages = num_stages(cfg)
    if SCHEDULES[cfg.pp_schedule][1] == "single":
        stand_in(cfg, n_microbatches)  # torch's own refusal of the count
        queues = {r: _single_stage_ops(cfg.pp_schedule, r, n_stages, n_microbatches)
                  for r in range(cfg.pp)}
    else:
        order = stand_in(cfg, n_microbatches).pipeline_order
        queues = {r: [op for a in acts for op in _compute_ops(a)] for r, acts in order.items()}
    done: dict[tuple[str, int, int], float] = {}
    free = dict.fromkeys(queues, 0.0)
    busy = dict.fromkeys(queues, 0.0)
    pos = dict.fromkeys(queues, 0)
    progress = True
    while progress:
        progress = False
        for r, ops in queues.items():
            while pos[r] < len(ops):
                kind, stage, mb = ops[pos[r]]
                ready = _ready(kind, stage, mb, done, n_stages)
                if ready is None:
                    break
                start = max(ready, free[r])
                free[r] = start + COST[kind]
                busy[r] += COST[kind]
                done[(kind, stage, mb)] = free[r]
                pos[r] += 1
                progress = True
    if any(pos[r] < len(ops) for r, ops in queues.items()):
        raise RuntimeError(f"pipeline timetable of {cfg.pp_schedule} did not complete")
    span = max(free.values())
    return 1.0 - sum(busy.values()) / (len(queues) * span) if span else 0.0


def build_schedule(cfg, stages: list, n_microbatches: int, loss_fn):
    """The schedule over this rank's ``PipelineStage`` objects. Gradients are not rescaled by
    the schedule: the loss is already divided by the step's micro-batch count (as the standard
    step does), so pipelined and plain steps accumulate the same gradients."""
    cls = schedule_class(cfg.pp_schedule)
    first = stages[0] if SCHEDULES[cfg.pp_schedule][1] == "single" else stages
    return cls(first, n_microbatches, loss_fn=loss_fn, scale_grads=False)


def hidden_dtype(cfg, fsdp: bool) -> torch.dtype:
    """The dtype of activations between stages: FSDP2's bf16 parameters make the residual
    stream bf16; otherwise it stays fp32 (autocast keeps the residual adds in fp32)."""
    return torch.bfloat16 if fsdp and cfg.param_dtype == "bfloat16" else torch.float32

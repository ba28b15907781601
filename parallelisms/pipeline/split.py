"""Which layers each pipeline stage holds, and which rank holds each stage (pure planning).

A model is cut into ``pp x stages_per_rank`` stages of consecutive blocks; the first stage also
holds the embeddings, the last the final norm, the head and the loss (the model family names
those modules: ``pipeline_ends``, docs/design.md "Pipeline stage contract"). Stage ``s`` lives on
pipeline rank ``s mod pp`` for the looped schedules (GPipe, 1F1B, interleaved: ``pp`` ranks
take turns) and on ``s`` or ``2 pp - 1 - s`` for the V-shaped ones (ZBV, DualPipeV: the first and
last stages share rank 0). ``parallelism.pp_split`` sets the layers per stage by hand; otherwise
the cut minimises the most expensive stage's training FLOPs per token (6 x its matmul parameters
plus its attention term; the embedding lookup costs no FLOPs, the head ``6 x vocab x dim``).

Used by ``parallelize`` (the real split), ``kiln validate`` (per-stage memory) and the recipe
checks (``pipeline_problems``), so a split that cannot work is refused with the same words
everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

from torch import nn

# schedule name -> (torch class in torch.distributed.pipelining, how stages sit on the ranks)
SCHEDULES: dict[str, tuple[str, str]] = {
    "gpipe": ("ScheduleGPipe", "single"),
    "1f1b": ("Schedule1F1B", "single"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop"),
    "interleaved_zero_bubble": ("ScheduleInterleavedZeroBubble", "loop"),
    "zbv_zero_bubble": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
}


def stages_per_rank(cfg) -> int:
    style = SCHEDULES[cfg.pp_schedule][1]
    return 1 if style == "single" else 2 if style == "v" else cfg.pp_stages_per_rank


def num_stages(cfg) -> int:
    return cfg.pp * stages_per_rank(cfg)


def stage_rank(cfg, stage: int) -> int:
    """The pipeline rank (0 .. pp - 1) holding ``stage``."""
    if SCHEDULES[cfg.pp_schedule][1] == "v" and stage >= cfg.pp:
        return 2 * cfg.pp - 1 - stage
    return stage % cfg.pp


def rank_stages(cfg, pp_rank: int) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in increasing order."""
    return [s for s in range(num_stages(cfg)) if stage_rank(cfg, s) == pp_rank]


@dataclass(frozen=True)
class StageCosts:
    """Training FLOPs per token of each block, and of the first and last stage's extra parts."""

    blocks: list[float]
    first: float
    last: float


def block_cost(block: nn.Module, seq_len: int) -> float:
    """6 x matmul parameters + the attention score/mix term (as the model's FLOP count)."""
    n = sum(p.numel() for p in block.parameters())
    attn = getattr(block, "attention", None)
    own = getattr(attn, "attention_flops_per_token", None)
    if own is not None:
        return 6.0 * n + float(own(seq_len))
    if attn is not None and hasattr(attn, "n_heads") and hasattr(attn, "head_dim"):
        return 6.0 * n + 12.0 * attn.n_heads * attn.head_dim * seq_len
    return 6.0 * n


def stage_costs(model: nn.Module, blocks: list[nn.Module], seq_len: int) -> StageCosts:
    """Per-block costs; the head (its matmul) on the last stage, embeddings (a lookup) free."""
    last = 0.0
    for name in model.pipeline_ends["last"]:
        module = getattr(model, name)
        last += 6.0 * sum(p.numel() for p in module.parameters())
    return StageCosts([block_cost(b, seq_len) for b in blocks], 0.0, last)


def balanced_split(costs: StageCosts, n_stages: int) -> list[int]:
    """Layers per stage (each >= 1, in order) minimising the most expensive stage; ties go to
    the split whose earlier stages hold more layers (the last stage also computes the loss)."""
    blocks = costs.blocks
    n = len(blocks)
    prefix = [0.0]
    for c in blocks:
        prefix.append(prefix[-1] + c)

    def cost(stage: int, lo: int, hi: int) -> float:
        extra = (costs.first if stage == 0 else 0.0) + (costs.last if stage == n_stages - 1
                                                          else 0.0)
        return prefix[hi] - prefix[lo] + extra

    @cache
    def best(stage: int, lo: int) -> tuple[float, tuple[int, ...]]:
        """Cheapest max cost for stages stage.. over blocks lo..n-1, with its counts."""
        if stage == n_stages - 1:
            return cost(stage, lo, n), (n - lo,)
        options = []
        for hi in range(n - (n_stages - stage - 1), lo, -1):  # more layers first on ties
            rest, counts = best(stage + 1, hi)
            options.append((max(cost(stage, lo, hi), rest), (hi - lo, *counts)))
        return min(options, key=lambda o: o[0])

    return list(best(0, 0)[1])


def split_problems(cfg, n_layers: int) -> list[str]:
    """What is wrong with ``pp`` / ``pp_split`` for a model of ``n_layers`` blocks."""
    stages = num_stages(cfg)
    problems = []
    if stages > n_layers:
        per = f" ({cfg.pp} x {stages // cfg.pp} stages per rank)" if stages != cfg.pp else ""
        problems.append(
            f"parallelism.pp = {cfg.pp}{per} needs {stages} stages of at least one layer, but "
            f"the model has {n_layers} layers (model.n_layers); lower parallelism.pp"
            + (" or parallelism.pp_stages_per_rank" if per else ""))
    if cfg.pp_split:
        if len(cfg.pp_split) != stages:
            problems.append(
                f"parallelism.pp_split = {cfg.pp_split} has {len(cfg.pp_split)} entries, but "
                f"parallelism.pp = {cfg.pp} with pp_schedule = \"{cfg.pp_schedule}\" makes "
                f"{stages} stages: give one layer count per stage")
        elif sum(cfg.pp_split) != n_layers or min(cfg.pp_split) < 1:
            problems.append(
                f"parallelism.pp_split = {cfg.pp_split} does not cover the model's {n_layers} "
                f"layers (model.n_layers): give each stage at least one layer, summing to "
                f"{n_layers}")
    return problems


def layer_split(cfg, model: nn.Module, blocks: list[nn.Module], seq_len: int) -> list[int]:
    """Layers per stage: ``pp_split`` or balanced (call after ``split_problems`` is empty)."""
    if cfg.pp_split:
        return list(cfg.pp_split)
    return balanced_split(stage_costs(model, blocks, seq_len), num_stages(cfg))


def stage_layers(counts: list[int], keys: list[str]) -> list[list[str]]:
    """Block keys of each stage from the layer counts."""
    out, start = [], 0
    for c in counts:
        out.append(keys[start:start + c])
        start += c
    return out


def runs_per_step(cfg, grad_accum: int) -> tuple[int, int]:
    """(pipeline runs per optimizer step, micro-batches per run)."""
    per_run = cfg.pp_microbatches or grad_accum
    return grad_accum // per_run, per_run

"""Helpers of the step components. What a step returns and what a guard decides are defined
with the other contracts in ``components/protocols.py``."""

from __future__ import annotations

import math

import torch

from kiln.components.protocols import GuardDecision, StepResult

__all__ = ["GuardDecision", "StepResult", "finite", "unguarded"]


def finite(t: torch.Tensor | None) -> bool:
    return t is None or bool(torch.isfinite(t).all())


def unguarded(stats: dict[str, float], *, first: bool = False) -> GuardDecision:
    """The decision when the recipe has no guard: a non-finite statistic aborts the run before
    its optimizer step, which would write NaN into the weights (and every later snapshot).
    ``first``: no optimizer step has run yet, so the learning rate cannot be the cause."""
    bad = [f"{k} = {v}" for k, v in stats.items() if not math.isfinite(v)]
    if not bad:
        return GuardDecision()
    if first:
        return GuardDecision(abort=True, reason=(
            f"not finite ({', '.join(bad)}) before any optimizer step, so the learning rate "
            "is not the cause: the starting weights (the model's init settings, e.g. "
            "model.init_std, an adapter's scale adapter.alpha, or checkpoint.init_from), a "
            "loss setting (a weight or beta, "
            "e.g. training.step.loss.beta, model.ffn.aux_loss_coeff) or the data give it; "
            "check those and rerun"))
    return GuardDecision(abort=True, reason=(
        f"not finite ({', '.join(bad)}) and the recipe has no guard, so kiln stopped before "
        "this optimizer step: the weights and the last checkpoint stay finite. Lower "
        "optimizer.lr (or set training.grad_clip) and rerun the same command to continue from "
        "the last checkpoint, or add a [guards.spike] table with type = \"spike_guard\" (its "
        "options: `kiln list guard`), which skips such steps (adding a guard to a run resumes "
        "from its checkpoint with checkpoint.weights_only = true)"))


@torch.no_grad()
def reference_logprobs(ctx, batch: dict[str, torch.Tensor], reference: torch.nn.Module | None,
                       adapters_off, **sampler) -> torch.Tensor:
    """A reference's token log-probabilities (B, T) of ``batch``: a frozen model's, or the
    policy's within ``adapters_off`` (in eval mode, so without dropout; the auxiliary loss of
    an MoE policy's forward dropped). ``sampler``: ``temperature`` / ``vocab`` as
    ``ctx.token_logprobs`` takes them."""
    if reference is not None:
        return ctx.token_logprobs(batch, reference, **sampler)[0]
    policy = ctx.model
    was_training = policy.training
    policy.eval()
    try:
        with adapters_off:
            logp = ctx.token_logprobs(batch, **sampler)[0]
        policy.pop_aux_loss()
    finally:
        policy.train(was_training)
    return logp


def sharing_line(build, once: str, rows: str) -> str:
    """The start-up line of ``share_prompts``: "step: ``once`` where ..." when the prompts are
    computed once, else why the model runs ``rows`` whole (``build.shared_prefix_problem``)."""
    from kiln.components.attention.shared_prefix import MIN_SHARE

    why = build.shared_prefix_problem()
    if why is None:
        return f"step: {once} where it is at least {MIN_SHARE:.3g} of the row (share_prompts)"
    return f"step: share_prompts: the {rows} run whole, {why}"


def sequence_parallel_refusal(step: str, layout) -> None:
    """A step built on whole sequences' log-probabilities refuses layouts where a rank lacks
    them (a RecipeError naming the setting)."""
    from kiln.components.errors import RecipeError

    why = ("parallelism.tp > 1 (vocabulary-sharded logits)" if layout.tp > 1
           else "parallelism.cp > 1 (a rank holds part of each sequence)" if layout.cp > 1
           else "parallelism.pp > 1 (the logits live on the last stage)" if layout.pp > 1
           else "")
    if why:
        raise RecipeError(f"training.step.type = {step!r} is not supported with {why} yet; "
                          "use data parallelism (FSDP2) alone")

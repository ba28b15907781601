"""The standard step: gradient accumulation over micro-batches, clip, guard, optimizer step.

Under pipeline parallelism (``ctx.pipeline``) the micro-batches' forward and
backward run through the pipeline schedule instead of the loop; the loss comes back from the
last stage, the same on every rank, so what follows (gradient sync, the global clip, the guards'
one decision, the optimizer step) is unchanged.
"""

from __future__ import annotations

import torch

from kiln.components.base import ComponentConfig
from kiln.components.protocols import StepContext, StepContract, StepResult
from kiln.components.registry import register


class StandardStepConfig(ComponentConfig):
    pass


@register("step", "standard")
class StandardStep(StepContract):
    """Forward/backward every micro-batch, then one clipped, guarded optimizer step."""

    Config = StandardStepConfig
    token_weighted = True  # weights micro-batches by their trained tokens for masked data

    def __init__(self, cfg: StandardStepConfig):
        self.cfg = cfg

    def __call__(self, ctx: StepContext,
                 micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        ctx.zero_grad()
        pipeline = ctx.pipeline
        trained = None
        if pipeline is not None:
            total = pipeline.train(micro_batches, ctx.stage_loss, ctx.autocast)
        else:
            total, trained = self.accumulate(ctx, micro_batches)
        ctx.sync_grads()
        grad_norm = ctx.clip_grads()
        stats = ctx.global_stats(loss=total, grad_norm=grad_norm)  # the one host sync
        decision = ctx.guard_decision(stats, segment=0)
        ctx.optimizer_step(decision, stats, segment=0, last_segment=True)
        return StepResult(
            loss=stats["loss"], tokens=ctx.tokens_per_step, grad_norm=stats.get("grad_norm"),
            skipped=decision.skip, reason=decision.reason,
            metrics={} if trained is None else {"trained_tokens": float(trained)},
        )

    @staticmethod
    def accumulate(ctx: StepContext,
                   micro_batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, int | None]:
        """Forward and backward of every micro-batch: (this rank's share of the mean loss,
        the global batch's trained tokens for masked data, else None)."""
        n = len(micro_batches)
        total = torch.zeros((), device=ctx.device)
        weights, trained = ctx.micro_weights(micro_batches) if ctx.token_weighted \
            else (None, None)
        for i, batch in enumerate(micro_batches):
            with ctx.grad_sync(i == n - 1):
                loss = ctx.forward_loss(batch)
                # 1/n: a mean over the step's tokens; masked data: weighted by trained tokens
                loss = loss / n if weights is None else loss * weights[i]
                loss.backward()
            total += loss.detach()
        return total, trained

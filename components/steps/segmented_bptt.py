"""Segmented BPTT: one global step of a looped model as ceil(H / K) optimizer steps.

For each segment of K loops: every micro-batch runs its loops from the state the previous
segment left (detached: no graph crosses a segment boundary, so activation memory grows with
K, not H), the loss is read through the coda and head, backward, gradient sync and clip, the
guards decide from the global statistics, and the optimizers step (those with ``step_every =
"global"`` only on the last segment). A skipped segment ends the global step: later segments
would start from a state that the rejected update should not have shaped. Embeddings and the
prelude are recomputed per segment with the weights of that moment.

The model must offer ``loop_window(start, stop, slot=, state=)`` and ``loops`` (the looped
model); K = H is exactly the standard step.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kiln.components import registry
from kiln.components.base import ComponentConfig
from kiln.components.errors import RecipeError
from kiln.components.protocols import StepContext, StepContract, StepResult
from kiln.components.registry import register


class SegmentedBPTTConfig(ComponentConfig):
    segment_loops: int = Field(
        0, ge=0, description="K: loops per segment, one optimizer step each (0 = all H)"
    )


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The looped model under torch.compile / DDP-style wrappers (they keep it as .module or
    ._orig_mod)."""
    for attr in ("_orig_mod", "module"):
        inner = getattr(model, attr, None)
        if isinstance(inner, torch.nn.Module):
            return _unwrap(inner)
    return model


def _not_looped(model: str, model_type: str | None = None) -> str:
    named = f"model.type = {model_type!r} ({model})" if model_type else model
    return (f"training.step.type = \"segmented_bptt\" needs a looped model (one with "
            f"loop_window); {named} has none: use model.type = \"looped\" or "
            "training.step.type = \"standard\"")


@register("step", "segmented_bptt")
class SegmentedBPTT(StepContract):
    """Loops in segments of K, each with its own backward, guard check and optimizer step."""

    Config = SegmentedBPTTConfig

    def __init__(self, cfg: SegmentedBPTTConfig) -> None:
        self.cfg = cfg

    def check_recipe(self, recipe, layout) -> None:
        """The model must be a looped one (``loop_window``): refused here, for ``validate`` as
        for ``train``, rather than at the first step."""
        model_cls = registry.for_config(recipe.model).obj
        if not hasattr(model_cls, "loop_window"):
            raise RecipeError(_not_looped(model_cls.__name__, recipe.model.type))

    def segments(self, loops: int) -> list[tuple[int, int]]:
        k = self.cfg.segment_loops or loops
        return [(s, min(s + k, loops)) for s in range(0, loops, k)]

    def __call__(self, ctx: StepContext,
                 micro_batches: list[dict[str, torch.Tensor]]) -> StepResult:
        model = _unwrap(ctx.model)
        if not hasattr(model, "loop_window"):  # a step built outside a recipe (tests, plugins)
            raise RecipeError(_not_looped(type(model).__name__))
        model.set_progress(ctx.step, ctx.total_steps)
        n = len(micro_batches)
        states: list[torch.Tensor | None] = [None] * n
        plan = self.segments(model.loops)
        metrics: dict[str, float] = {}
        for seg, (start, stop) in enumerate(plan):
            last = seg == len(plan) - 1
            ctx.zero_grad()
            total = torch.zeros((), device=ctx.device)
            for i, batch in enumerate(micro_batches):
                with ctx.grad_sync(i == n - 1):
                    with model.loop_window(start, stop, slot=i, state=states[i]) as window:
                        loss = ctx.forward_loss(batch) / n
                    loss.backward()
                total += loss.detach()
                states[i] = None if last else window.state_out.detach()
            ctx.sync_grads()
            grad_norm = ctx.clip_grads()
            stats = ctx.global_stats(loss=total, grad_norm=grad_norm)  # one host sync
            decision = ctx.guard_decision(stats, segment=seg)
            ctx.optimizer_step(decision, stats, segment=seg, last_segment=last)
            metrics[f"loss/segment{seg}"] = stats["loss"]
            if decision.skip:
                break
        metrics["segments_done"] = float(seg + 1)
        return StepResult(
            loss=stats["loss"], tokens=ctx.tokens_per_step,
            grad_norm=stats.get("grad_norm"), skipped=decision.skip, reason=decision.reason,
            metrics=metrics,
        )

"""The preference step: DPO and its family on pairs of completions (``data.type =
"preference"``), with the loss a ``preference_loss`` component.

Each micro-batch of ``n`` pairs is ``2n`` rows (chosen, then rejected); one forward of the
policy gives every row's completion log-probability (``ctx.token_logprobs``: chunked with
``training.loss_chunk_tokens``, so the (rows, T, V) logits never exist), summed over the
completion tokens. The reference's come from a frozen model built and sharded like the policy
(``reference = "frozen_copy"``), or from the policy itself with its adapters switched off
(``"adapters_off"``: no second copy of the weights); ``"auto"`` picks the second with an
``[adapter]``, else the first, and none for a reference-free loss (SimPO, ORPO). The reference
forward runs in eval mode (no dropout) and without gradients; the start-up log says which
reference the run uses.

The loss is the mean over the global batch's pairs. The metrics carry TRL's names
(``rewards/chosen``, ``rewards/rejected``, ``rewards/margins``, ``rewards/accuracies``,
``logps/chosen``, ``logps/rejected``), averaged over the global batch; the evaluation logs the
same on the held-out pairs (``eval/rewards/accuracies``, ...).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from kiln.components.base import ComponentConfig, Sub, component
from kiln.components.errors import RecipeError
from kiln.components.protocols import StepContext, StepContract, StepResult
from kiln.components.registry import register
from kiln.components.steps import reference_table
from kiln.components.steps.common import (
    reference_logprobs,
    sequence_parallel_refusal,
    sharing_line,
)
from kiln.components.steps.preference_losses import PairLogps, PairLoss

Reference = Literal["auto", "frozen_copy", "adapters_off", "none"]
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
           "logps/chosen", "logps/rejected")


class PreferenceStepConfig(ComponentConfig):
    loss: Sub("preference_loss") = component(
        "preference_loss", "dpo", "the preference loss and its settings (`kiln list "
        "preference_loss`)")
    reference: Reference = Field(
        "auto", description='the reference model: "frozen_copy" (the starting weights, '
        'sharded like the policy), "adapters_off" (the policy without its [adapter]: no '
        'second copy), "none" (reference-free losses), "auto" (adapters_off with an adapter, '
        "else frozen_copy; none for a reference-free loss)")
    precompute_reference: bool = Field(
        False, description="compute the reference's log-probabilities of every pair once "
        "before the first step and keep them in the run folder (reference_logps.safetensors, "
        "read again on a resume); training then runs no reference forward and holds no "
        "frozen copy")
    precompute_micro_batch: int = Field(8, ge=1, description="pairs per forward while "
                                        "precomputing")
    share_prompts: bool = Field(
        True, description="compute each pair's shared prompt once in the forward (prefix "
        "sharing; the same values up to float rounding); models that cannot (Gated DeltaNet, "
        "MoE, dropout, compiled blocks) run the rows whole, as the start-up log says")


@register("step", "preference")
class PreferenceStep(StepContract):
    """A preference loss on chosen / rejected pairs, with a frozen reference or none."""

    Config = PreferenceStepConfig
    varying_width = True  # rows cut after their last label, prompts packed once
    trains_mtp = False  # scores the main head's log-probabilities

    def __init__(self, cfg: PreferenceStepConfig) -> None:
        self.cfg = cfg
        self.loss = cfg.loss.build()
        self.takes_pairs = "unpaired" if self.loss.unpaired else "paired"
        # held-out preference accuracy: judged by `kiln compare` (KTO's examples have no pair)
        self.scores = () if self.loss.unpaired else ("rewards/accuracies",)
        self.reference: torch.nn.Module | None = None  # a frozen copy
        self.adapters_off = None  # a context: the policy computes its base
        self.uses = "none"  # the reference this run uses
        self.stored: reference_table.Stored | None = None  # precomputed log-probabilities
        self.reference_forwards = 0  # counted: none with a precomputed reference

    def check_recipe(self, recipe, layout) -> None:
        """The pairs' log-probabilities need whole sequences and logits on every rank; a
        reference named by the recipe must exist in it."""
        sequence_parallel_refusal("preference", layout)
        needs = self.loss.needs_reference
        if needs and self.cfg.reference == "none":
            raise RecipeError(
                f"training.step.loss.type = {self.cfg.loss.type!r} needs a reference model, "
                'and training.step.reference = "none"; set it to "auto", "frozen_copy" or '
                '"adapters_off", or use a reference-free loss ("simpo", "orpo")')
        if needs and self.cfg.reference == "adapters_off" and recipe.adapter is None:
            raise RecipeError('training.step.reference = "adapters_off" needs an [adapter] '
                              '(LoRA, DoRA); without one use "frozen_copy" or "auto"')

    # ------------------------------------------------------------------ the reference
    def setup(self, build) -> None:
        want, needs = self.cfg.reference, self.loss.needs_reference
        name = f"training.step.loss.type = {self.cfg.loss.type!r}"
        self.log_sharing(build)
        if not needs:
            unused = [f"training.step.reference = {want!r}"] if want not in ("auto", "none") \
                else []
            unused += ["training.step.precompute_reference"] if self.cfg.precompute_reference \
                else []
            if unused:
                build.lines.append(f"step: warning: {name} is reference-free; "
                                   f"{' and '.join(unused)} not used")
            build.lines.append(f"step: {name}, reference-free (no reference model)")
            return
        if want in ("auto", "adapters_off"):  # (check_recipe refused the impossible ones)
            self.adapters_off = build.without_adapters()
        self.uses = "adapters_off" if self.adapters_off is not None else "frozen_copy"
        build.lines.append(f"step: {name}, reference = {self.uses}")
        if self.cfg.precompute_reference:  # a resume reads the table and builds no reference
            self.stored = reference_table.load(self, build)
        if self.stored is None and self.uses == "frozen_copy":
            self.reference = build.frozen_model("initial")
        if self.cfg.precompute_reference:
            self.stored = self.stored or reference_table.compute(self, build)
            self.reference = self.adapters_off = None  # no reference forward from here on
            self.uses = "precomputed"

    @torch.no_grad()
    def reference_logprobs(self, ctx: StepContext, batch, split: str = "train") -> torch.Tensor:
        """The reference's summed completion log-probability of every row (2n,)."""
        if self.stored is not None:  # precomputed: looked up by each row's pair and side
            return self.stored.lookup(split, batch).to(ctx.device)
        self.reference_forwards += 1
        return reference_logprobs(ctx, batch, self.reference, self.adapters_off,
                                  **self.groups(batch)).sum(-1)

    def groups(self, batch) -> dict[str, torch.Tensor]:
        """``token_logprobs``' ``groups`` of a micro-batch: pair i's rows are i and n + i
        (with ``share_prompts`` and pairs; an unpaired loss's rows share nothing)."""
        if not self.cfg.share_prompts or self.takes_pairs != "paired":
            return {}
        n = batch["input_ids"].shape[0] // 2
        return {"groups": torch.arange(2 * n).view(2, n).T}

    def log_sharing(self, build) -> None:
        """The start-up line saying whether the pairs' prompts are computed once."""
        if not self.cfg.share_prompts or self.takes_pairs != "paired":
            return
        build.lines.append(sharing_line(build, "each pair's prompt computed once per forward",
                                       "pairs"))

    # ------------------------------------------------------------------ the loss
    def pair_loss(self, ctx: StepContext, batch, split: str = "train"
                  ) -> tuple[PairLoss, PairLogps]:
        """The loss of one micro-batch's pairs, with the sequence log-probabilities."""
        ref = self.reference_logprobs(ctx, batch, split) if self.uses != "none" else None
        logp, trained = ctx.token_logprobs(batch, **self.groups(batch))
        seq, counts = logp.sum(-1), trained.sum(-1).to(logp.dtype)
        n = seq.shape[0] // 2
        logps = PairLogps(seq[:n], seq[n:], counts[:n], counts[n:],
                          *((ref[:n], ref[n:]) if ref is not None else (None, None)),
                          desirable=batch.get("desirable"))
        return self.loss(logps), logps

    def __call__(self, ctx: StepContext, micro_batches: list[dict[str, torch.Tensor]]
                 ) -> StepResult:
        ctx.zero_grad()
        n = len(micro_batches)
        total = torch.zeros((), device=ctx.device)
        sums: dict[str, torch.Tensor] = {}
        for i, batch in enumerate(micro_batches):
            with ctx.grad_sync(i == n - 1):
                out, logps = self.pair_loss(ctx, batch)
                loss = out.losses.mean()
                aux = ctx.model.pop_aux_loss()  # MoE: adds its gradient, not its value
                if aux is not None:
                    loss = loss + (aux - aux.detach())
                (loss / n).backward()
            total += out.losses.detach().mean() / n
            for key, v in metric_values(out, logps).items():
                sums[key] = sums.get(key, 0) + v / n
        ctx.sync_grads()
        grad_norm = ctx.clip_grads()
        stats = ctx.global_stats(loss=total, grad_norm=grad_norm, averaged=("loss", *sums),
                                 **sums)
        decision = ctx.guard_decision(stats, segment=0)
        ctx.optimizer_step(decision, stats, segment=0, last_segment=True)
        if self.stored is not None:
            self.stored.save_once()  # into the run folder, as the first step ends
        return StepResult(
            loss=stats["loss"], tokens=2 * ctx.tokens_per_step,  # both sides of every pair
            grad_norm=stats.get("grad_norm"), skipped=decision.skip, reason=decision.reason,
            metrics=ratios({k: stats[k] for k in sums}))

    def evaluate(self, ctx: StepContext, batch) -> dict[str, torch.Tensor]:
        """Per pair of one held-out micro-batch: the metrics' values (the hook averages)."""
        out, logps = self.pair_loss(ctx, batch, split="eval")
        if logps.desirable is not None:  # unpaired (KTO): the loss and the KL estimate
            return {"preference_loss": out.losses.detach(),
                    "kl": out.extra["kl"].expand_as(out.losses)}
        return {**pair_values(out, logps), "preference_loss": out.losses.detach()}


def pair_values(out: PairLoss, logps: PairLogps) -> dict[str, torch.Tensor]:
    """TRL's metrics, one value per pair (unpaired examples: per example, the desirable and
    undesirable ones' sums and counts, which ``ratios`` turns into means)."""
    c, r = out.chosen_rewards, out.rejected_rewards
    if logps.desirable is not None:
        good = logps.desirable.to(c.device)
        chosen, seq = good.float(), logps.chosen.detach()
        return {"rewards/chosen_sum": c.nan_to_num(), "rewards/rejected_sum": r.nan_to_num(),
                "logps/chosen_sum": seq * chosen, "logps/rejected_sum": seq * (1 - chosen),
                "count/chosen": chosen, "count/rejected": 1 - chosen}
    return dict(zip(METRICS, (c, r, c - r, (c > r).float(), logps.chosen.detach(),
                              logps.rejected.detach()), strict=True))


def ratios(values: dict[str, float]) -> dict[str, float]:
    """Unpaired examples' means from their sums and counts (TRL's KTO metrics); pairs' values
    unchanged."""
    if "count/chosen" not in values:
        return values
    out = {k: v for k, v in values.items() if not k.endswith("_sum")
           and not k.startswith("count/")}
    out["desirable_share"] = values["count/chosen"]  # of the global batch's examples
    for side in ("chosen", "rejected"):
        count = values[f"count/{side}"]
        for what in ("rewards", "logps"):
            out[f"{what}/{side}"] = values[f"{what}/{side}_sum"] / count if count else math.nan
    out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
    return out


def metric_values(out: PairLoss, logps: PairLogps) -> dict[str, torch.Tensor]:
    """The micro-batch's means of TRL's metrics, and the loss's own scalars."""
    return {**{k: v.mean() for k, v in pair_values(out, logps).items()}, **out.extra}

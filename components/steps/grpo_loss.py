"""The GRPO objective and its fixes, as functions of per-token log-probabilities: group
advantages, the clipped importance ratio, the k3 KL estimate and the loss aggregations.

- advantages: each completion's reward minus its group's mean (DeepSeekMath's GRPO), divided by
  the group's standard deviation (``scale = "group"``), the whole batch's (``"batch"``) or not
  at all (``"none"``: Dr. GRPO); the deviation is the unbiased one plus 1e-4, as TRL's;
- per token: ``-min(ρ A, clip(ρ, 1 - ε_low, 1 + ε_high) A)`` with ρ = exp(log p - log p_old)
  (PPO's clipped ratio; DAPO's clip-higher sets ε_high above ε_low), plus ``β`` times the k3
  estimate of KL(π || π_ref), ``exp(ref - log p) - (ref - log p) - 1``, times ρ with
  ``kl_correction`` (DeepSeek-V3.2's unbiased KL gradient; TRL's default);
- aggregation over a batch's completion tokens: ``"sequence"`` (GRPO: each completion's token
  mean, then the mean over completions), ``"token"`` (DAPO: the sum over all tokens divided by
  their count) and ``"constant"`` (Dr. GRPO: the sum divided by completions x max_new_tokens).
  The step passes the divisors of the whole global batch, so the mean over ranks of each rank's
  loss is the global batch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Aggregation = Literal["sequence", "token", "constant"]
Scale = Literal["group", "batch", "none"]
STD_EPS = 1e-4  # TRL's: added to the standard deviation


def group_advantages(rewards: torch.Tensor, group: int, scale: Scale,
                     batch_std: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages (N,), each group's rewards all equal (N,) bool) of rewards (N,) in groups of
    ``group`` consecutive completions. ``batch_std``: the global batch's standard deviation
    (``scale = "batch"``; the step all-reduces it)."""
    grouped = rewards.view(-1, group)
    mean = grouped.mean(1).repeat_interleave(group)
    std = grouped.std(1).repeat_interleave(group)  # unbiased (Bessel), as TRL's
    advantages = rewards - mean
    if scale == "group":
        advantages = advantages / (std + STD_EPS)
    elif scale == "batch":
        advantages = advantages / (batch_std + STD_EPS)
    return advantages, torch.isclose(std, torch.zeros_like(std))


@dataclass
class TokenTerms:
    """Per completion token (B, T): the loss, the ratio, the KL estimate (or None) and where
    the ratio was clipped below (negative advantages) and above (positive ones)."""

    loss: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None
    low_clipped: torch.Tensor
    high_clipped: torch.Tensor


def token_terms(logp: torch.Tensor, old: torch.Tensor, advantages: torch.Tensor, *,
                epsilon: float, epsilon_high: float, beta: float = 0.0,
                ref: torch.Tensor | None = None, kl_correction: bool = True) -> TokenTerms:
    """The clipped surrogate (and KL) per token of log-probabilities (B, T), advantages (B,)."""
    a = advantages.unsqueeze(1)
    ratio = torch.exp(logp - old)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    loss = -torch.min(ratio * a, clipped * a)
    kl = None
    if beta:
        if ref is None:
            raise ValueError("a KL term (beta > 0) needs the reference's log-probabilities")
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if kl_correction:
            kl = kl * ratio
        loss = loss + beta * kl
    return TokenTerms(loss, ratio, kl, (ratio < 1 - epsilon) & (a < 0),
                      (ratio > 1 + epsilon_high) & (a > 0))


def aggregate(loss: torch.Tensor, mask: torch.Tensor, how: Aggregation, *,
              completions: float, tokens: float, max_new_tokens: int) -> torch.Tensor:
    """The loss of a batch's token losses (B, T) under ``mask``, divided as ``how`` says:
    ``completions`` and ``tokens`` count the batch the mean is over (this rank's share of the
    global batch when the ranks' gradients are averaged)."""
    m = mask.to(loss.dtype)
    if how == "sequence":
        return ((loss * m).sum(-1) / m.sum(-1).clamp(min=1)).sum() / completions
    if how == "token":
        return (loss * m).sum() / max(tokens, 1.0)
    return (loss * m).sum() / (completions * max_new_tokens)

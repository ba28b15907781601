"""Attention-logit figures for diagnostics: the largest pre-softmax logit and the entropy of each
query's attention distribution. Logits that grow without bound drive the softmax one-hot
(entropy -> 0), the failure QK-norm guards against; the fused SDPA kernels never show the logits,
so they are recomputed from q and k, on diagnostic steps only.

An attention module takes part by defining ``score_inputs(x) -> [(q, k), ...]``: for each
softmax map of a training forward on ``x``, its queries and keys (B, H, T, D) as SDPA would
see them (projected, normalised, rotated; this rank's heads). ``causal`` and ``differential``
do.
"""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def causal_logit_stats(q: torch.Tensor, k: torch.Tensor, rows: int = 0,
                       max_elements: int = 2**24) -> torch.Tensor:
    """q (B, Hq, T, D), k (B, Hk, T, D) -> fp32 [max logit, summed row entropy (nats), rows].

    Scaled like SDPA (1/sqrt(D)), causal; kv heads serve ``Hq / Hk`` query heads each.
    ``rows`` > 0 reads about that many query positions per sequence, evenly spaced and ending at
    the last (the same positions on every rank and layout), instead of all T: the logits are
    recomputed outside the fused kernel, at a cost that grows with T^2. Computed a few heads at
    a time so at most ``max_elements`` logits exist at once.
    """
    b, hq, t, d = q.shape
    group = hq // k.shape[1]
    stride = max(1, -(-t // rows)) if rows else 1
    pos = torch.arange(t - 1, -1, -stride, device=q.device).flip(0)  # (R,) query positions
    future = torch.arange(t, device=q.device)[None, :] > pos[:, None]  # (R, T) masked keys
    low = torch.finfo(torch.float32).min  # masked logits: exp() gives exactly 0, 0 * low = 0
    top = torch.full((), float("-inf"), device=q.device)
    entropy = torch.zeros((), device=q.device)
    step = max(1, max_elements // (pos.numel() * t))
    for i in range(b):
        for h0 in range(0, hq, step):
            heads = torch.arange(h0, min(h0 + step, hq), device=q.device)
            qs = q[i, heads][:, pos].float() * d**-0.5  # (n, R, D)
            logits = qs @ k[i, heads // group].float().mT  # (n, R, T)
            logits.masked_fill_(future, low)
            top = torch.maximum(top, logits.amax())
            lse = torch.logsumexp(logits, -1)  # (n, R)
            p = torch.exp(logits - lse[..., None])
            entropy += lse.sum() - (p * logits).sum()  # H = lse - sum p * logit, per row
    rows_done = torch.tensor(float(b * hq * pos.numel()), device=q.device)
    return torch.stack([top, entropy, rows_done])


@torch.no_grad()  # nothing saved for backward: an activation-checkpointed block recomputes
def attention_logit_stats(module: nn.Module, x: torch.Tensor,
                          rows: int = 0) -> torch.Tensor | None:
    """[max logit, entropy sum, rows] over every softmax map of ``module`` on input ``x`` (at
    about ``rows`` query positions per sequence, 0 = all); None for an attention without
    ``score_inputs``."""
    inputs = getattr(module, "score_inputs", None)
    if inputs is None:
        return None
    parts = [causal_logit_stats(q, k, rows) for q, k in inputs(x)]
    stacked = torch.stack(parts)  # (maps, 3)
    return torch.stack([stacked[:, 0].max(), stacked[:, 1].sum(), stacked[:, 2].sum()])

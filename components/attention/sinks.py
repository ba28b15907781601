"""Attention with learned sinks (gpt-oss): each head's sink logit s joins the softmax of every
query as a key without a value, so a query may attend to "nothing".

With the keys' log-sum-exp L of a query, the sink only rescales plain attention's output:
``out = softmax(scores) V * exp(L - L')`` with ``L' = logaddexp(L, s)``. On CPU, PyTorch's flash
kernel returns L beside the output (``aten._scaled_dot_product_flash_attention_for_cpu``), so a
sink layer runs that kernel and rescales, never holding the (B, H, Tq, T) scores. Its backward
is the same kernel's backward given the rescaled output and L' as the log-sum-exp: with the sink
among the keys, the probabilities are exp(score - L'), and the row term the kernel subtracts,
dO . O, is then exactly the one the sink softmax needs. The sink's own gradient is
``-sum over queries of p_sink * (dO . O)`` with ``p_sink = exp(s - L')``.

Elsewhere (CUDA, attention dropout) the softmax is written out over the scores with the sink
appended (``written_out``): the public SDPA does not return L. On the recipe-sized gpt-oss
blocks of ``scripts/bench_peers.py`` (4 x 256 tokens, 4 heads of 64) the kernel path ran a
layer's forward and backward in 9.5 ms against 12 ms written out (AMD EPYC, 2 threads).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _SinkFlash(torch.autograd.Function):
    """The CPU flash kernel with sinks (module doc). ``mask``: additive, q's dtype, or None
    with ``causal``."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, causal: bool):
        out, lse = _flash(q, k, v, 0.0, causal, attn_mask=mask)  # lse (B, H, Tq) fp32
        lse_sink = torch.logaddexp(lse, sinks.float().view(1, -1, 1))
        out = out * (lse - lse_sink).exp().unsqueeze(-1).to(out.dtype)
        ctx.save_for_backward(q, k, v, sinks, out, lse_sink, mask)
        ctx.causal = causal
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, sinks, out, lse_sink, mask = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = _flash_backward(grad, q, k, v, out, lse_sink, 0.0, ctx.causal,
                                     attn_mask=mask)
        p_sink = (sinks.float().view(1, -1, 1) - lse_sink).exp()  # (B, H, Tq)
        dsinks = -(p_sink * (grad.float() * out.float()).sum(-1)).sum((0, 2))
        return dq, dk, dv, dsinks.to(sinks.dtype), None, None


def _causal_mask(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(Tq, T) bool: the Tq queries are the last Tq positions of the T keys."""
    t, tq = k.shape[2], q.shape[2]
    return torch.ones(tq, t, dtype=torch.bool, device=q.device).tril(t - tq)


def written_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                sinks: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """The sink softmax over the full scores (any device, attention dropout)."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:  # GQA: each kv head serves its group of query heads
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (q @ k.transpose(-2, -1)).float() * q.shape[-1] ** -0.5  # (B, H, Tq, T)
    if mask is None:
        mask = _causal_mask(q, k)
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    if dropout_p:
        probs = F.dropout(probs, p=dropout_p)
    return probs.to(v.dtype) @ v


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any,
                   sinks: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """q (B, H, Tq, D) over k, v (B, Hk, T, D) with sinks (H,). ``mask``: additive (0 / -inf)
    or bool, broadcast to (B, H, Tq, T), or None (causal, the queries being the last Tq
    positions). The CPU flash kernel where it applies, else ``written_out`` (module doc)."""
    if q.device.type != "cpu" or dropout_p or q.dtype not in (torch.float32, torch.bfloat16):
        return written_out(q, k, v, mask, sinks, dropout_p)
    causal = mask is None and q.shape[2] == k.shape[2]
    if mask is None and not causal:
        mask = _causal_mask(q, k)
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros_like(mask, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        mask = mask.to(q.dtype)
    return _SinkFlash.apply(q, k, v, sinks, mask, causal)

"""Differential attention (Ye et al. 2024, "Differential Transformer", microsoft/unilm layout).

Each head of width ``hd`` splits its q and k into two halves of width ``d = hd / 2``; each half
gives a causal softmax map, and the head attends with their difference to a value of full
width ``hd``::

    A_c = softmax(q_c k_c^T / sqrt(d) + causal)      c = 1, 2   (per head, GQA on k and v)
    out = (A_1 - lambda * A_2) v                     computed as A_1 v - lambda * A_2 v
    out = RMSNorm_hd(out) * (1 - lambda_init)        one norm shared by the heads
    lambda = exp(lq1 . lk1) - exp(lq2 . lk2) + lambda_init, lambda_init = 0.8 - 0.6 exp(-0.3 l)

with ``l`` the 0-based layer index (the paper's ``l - 1`` for 1-based depth; unilm passes the
0-based index). The two maps are two SDPA calls on half-width q/k with the full-width v (so any
fused SDPA backend is used). As in unilm, RoPE rotates each half as its own sub-head (a table of
width ``d``); QK-norm, which the paper does not use, normalises each half too, since each half
feeds its own softmax.

Grouped-query heads pair as in the official flash implementation (``multihead_flashdiff_*``):
half ``c`` of query head ``i`` attends with half ``c`` of kv head ``i // (H / Hk)``. The official
explicit-softmax ``multihead_diffattn.py`` repeats the ``2 Hk`` kv sub-heads instead, so its
query sub-head ``2i + c`` meets kv sub-head ``(2i + c) // (H / Hk)``: under GQA both halves of a
query head can meet the same kv half. Without GQA (Hk = H) the two are identical.

``lambda_mode = "per_head"`` is the 10B reference script's simplification: a directly learnable
lambda per head (initialised to lambda_init) instead of the exp re-parameterisation. The
reference script concatenates ``[A_1 v_1, lambda A_2 v_2]`` over half-width values, which is
not a difference of maps at all; kiln keeps the differential form. ``head_gate`` adds the
reference's learnable per-head output gate (initialised to 1).

Projections, QK-norm modules and the position sub-component are the causal attention's; so is
the KV cache (it stores the rotated half-width keys and the full-width values). Under tensor
parallelism a rank computes whole heads (both maps of a head on one rank): head counts come from
the projection shapes, and per-head parameters are read at ``head_offset``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from kiln.components.attention.causal import CausalAttention, CausalAttentionConfig
from kiln.components.attention.context import AttentionContext, sdpa
from kiln.components.attention.kv_cache import cached_sdpa
from kiln.components.norms.rmsnorm import RMSNorm, RMSNormConfig
from kiln.components.registry import register


class DifferentialAttentionConfig(CausalAttentionConfig):
    lambda_mode: Literal["reparam", "per_head"] = Field(
        "reparam",
        description="reparam: lambda = exp(lq1.lk1) - exp(lq2.lk2) + lambda_init (the paper); "
        "per_head: one learnable lambda per head (the 10B reference's simplification)",
    )
    lambda_init_schedule: Literal["depth", "constant"] = Field(
        "depth", description="depth: 0.8 - 0.6*exp(-0.3*layer_idx); constant: `lambda_init`"
    )
    lambda_init: float = Field(0.8, description="lambda_init when lambda_init_schedule = constant")
    lambda_std: float = Field(0.1, ge=0, description="init std of the lambda vectors (reparam)")
    head_gate: bool = Field(False, description="learnable per-head output gate (init 1)")
    head_norm_eps: float = Field(1e-5, gt=0, description="eps of the per-head RMSNorm")

    def shape_problem(self, dim: int) -> str | None:
        """The causal checks, and a head width that splits into two rotated halves."""
        problem = self.heads_problem(dim)
        hd = self.head_dim or dim // self.n_heads
        if problem is None and hd % 4:
            problem = (f"differential attention splits each head in two rotated halves, so the "
                       f"head width ({'attention.head_dim' if self.head_dim else 'dim / n_heads'}"
                       f" = {hd}) must be a multiple of 4: change dim, attention.n_heads or "
                       "attention.head_dim")
        if problem is None and self.sinks:
            problem = ("attention.sinks are for causal attention (gpt-oss); differential "
                       "attention has none: set attention.sinks = false")
        return problem


def depth_lambda_init(layer_idx: int) -> float:
    """The paper's lambda_init for the block at 0-based ``layer_idx``."""
    return 0.8 - 0.6 * math.exp(-0.3 * layer_idx)


@register("attention", "differential")
class DifferentialAttention(CausalAttention):
    """Differential attention: difference of two softmax maps per head (GQA, RoPE, QK-norm)."""

    Config = DifferentialAttentionConfig

    def __init__(
        self, cfg: DifferentialAttentionConfig, *, dim: int, layer_idx: int, n_layers: int,
        max_seq_len: int,
    ) -> None:
        super().__init__(cfg, dim=dim, layer_idx=layer_idx, n_layers=n_layers,
                         max_seq_len=max_seq_len)
        hd = self.head_dim
        half = hd // 2  # cfg.shape_problem checked hd: a multiple of 4
        # Sub-heads of width hd/2: their own QK-norm and RoPE table (replacing the causal ones).
        if cfg.qk_norm:
            norm_cfg = RMSNormConfig(type="rmsnorm", eps=cfg.qk_norm_eps)
            self.q_norm = RMSNorm(norm_cfg, dim=half)
            self.k_norm = RMSNorm(norm_cfg, dim=half)
        self.position = cfg.position.build(head_dim=half, max_seq_len=max_seq_len)
        self.lambda_mode = cfg.lambda_mode
        self.lambda_std = cfg.lambda_std
        self.lambda_init = (depth_lambda_init(layer_idx) if cfg.lambda_init_schedule == "depth"
                            else cfg.lambda_init)
        if cfg.lambda_mode == "reparam":
            self.lambda_q1 = nn.Parameter(torch.empty(half))
            self.lambda_k1 = nn.Parameter(torch.empty(half))
            self.lambda_q2 = nn.Parameter(torch.empty(half))
            self.lambda_k2 = nn.Parameter(torch.empty(half))
        else:
            self.lambda_head = nn.Parameter(torch.empty(self.n_heads))
        self.head_gate = nn.Parameter(torch.empty(self.n_heads)) if cfg.head_gate else None
        self.head_norm = RMSNorm(RMSNormConfig(type="rmsnorm", eps=cfg.head_norm_eps), dim=hd)
        self.head_offset = 0  # first head this rank computes (tensor parallelism sets it)
        if not self.wo.weight.is_meta:
            self._init_extra()

    @torch.no_grad()
    def _init_extra(self) -> None:
        if self.lambda_mode == "reparam":
            for p in (self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2):
                nn.init.normal_(p, mean=0.0, std=self.lambda_std)
        else:
            nn.init.constant_(self.lambda_head, self.lambda_init)
        if self.head_gate is not None:
            nn.init.ones_(self.head_gate)
        self.head_norm.reset_parameters()

    def init_weights(self, std: float, out_std: float) -> None:
        super().init_weights(std, out_std)
        self._init_extra()

    def lambda_value(self, heads: int = 0) -> torch.Tensor:
        """lambda of this rank's ``heads`` (0 = all), shape (heads,) (the reparam value is shared
        by the heads), fp32."""
        heads = heads or self.n_heads
        if self.lambda_mode == "per_head":
            return self._my_heads(self.lambda_head, heads).float()
        lam1 = torch.exp((self.lambda_q1.float() * self.lambda_k1.float()).sum())
        lam2 = torch.exp((self.lambda_q2.float() * self.lambda_k2.float()).sum())
        return (lam1 - lam2 + self.lambda_init).expand(heads)

    def _my_heads(self, per_head: torch.Tensor, heads: int) -> torch.Tensor:
        """The entries of a per-head parameter (H,) for the heads this rank computes: all of
        them, or under tensor parallelism ``heads`` from ``head_offset`` (set by the plan; the
        parameter stays whole on every rank and its gradient is summed over the ranks)."""
        if heads == per_head.shape[0]:
            return per_head
        return per_head.narrow(0, self.head_offset, heads)

    def score_inputs(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The two softmax maps' q (B, H, T, d) and k (B, Hk, T, d), as in ``forward``."""
        b, t, _ = x.shape
        q, k, _ = self.project_qkv(x)
        h, hk, half = q.shape[2], k.shape[2], self.head_dim // 2
        q, k = q.reshape(b, t, 2 * h, half), k.reshape(b, t, 2 * hk, half)
        q, k = self.normed(q, k)
        q, k = self.position(q, k)
        q, k = q.reshape(b, t, h, 2, half), k.reshape(b, t, hk, 2, half)
        return [(q[:, :, :, c].transpose(1, 2), k[:, :, :, c].transpose(1, 2)) for c in (0, 1)]

    def forward(self, x: torch.Tensor, *,
                context: AttentionContext | None = None) -> torch.Tensor:  # (B, T, dim) -> same
        """``context``: document mask / context parallel (``attention/context.py``)."""
        b, t, _ = x.shape
        q, k, v = self.project_qkv(x)  # (B, T, H, 2d), (B, T, Hk, 2d), (B, T, Hk, 2d)
        h, hk, half = q.shape[2], k.shape[2], self.head_dim // 2  # this rank's heads
        q = q.reshape(b, t, 2 * h, half)  # (B, T, 2H, d): sub-head 2i+c is half c of head i
        k = k.reshape(b, t, 2 * hk, half)  # (B, T, 2Hk, d)
        q, k = self.normed(q, k)
        cache, w = self.kv_cache, self.window
        if cache is None and context is not None:  # both maps under the context's mask
            q, k = self.position(q, k, **context.rope_args())
            k, v = context.gather(k), context.gather(v)  # (B, T_all, 2Hk, d), (B, T_all, Hk, 2d)
            attend = lambda q_, k_, v_, c: sdpa(q_, k_, v_, context, window=w)  # noqa: E731
        elif cache is None and w:
            q, k = self.position(q, k)
            attend = lambda q_, k_, v_, c: sdpa(q_, k_, v_, None, window=w)  # noqa: E731
        elif cache is None:
            q, k = self.position(q, k)
            attend = lambda q_, k_, v_, c: F.scaled_dot_product_attention(  # noqa: E731
                q_, k_, v_, is_causal=True, enable_gqa=hk != h)
        else:  # decoding: the rotated keys and the values of earlier tokens are cached
            session = cache.session
            q, k = self.position(q, k, positions=session.positions, limit=session.limit)
            # cached in SDPA's layout: (B, 2Hk, S, d), (B, Hk, S, 2d)
            k, v = cache.update(k.transpose(1, 2), v.transpose(1, 2), shareable=True)
            prefix = cache.prefix()  # a group's shared prompt: (P, 2Hk, L, d), (P, Hk, L, 2d)
            halves = None if prefix is None else \
                prefix[0].view(prefix[0].shape[0], hk, 2, -1, half)  # as k below

            def attend(q_, k_, v_, c):
                shared = None if halves is None else (halves[:, :, c], prefix[1])
                return cached_sdpa(q_, k_, v_, session, w, prefix=shared)
        if cache is None:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, 2Hk, S, d), (B, Hk, S, 2d)
        q = q.reshape(b, t, h, 2, half).transpose(1, 2)  # (B, H, T, 2, d)
        k = k.view(b, hk, 2, -1, half)  # (B, Hk, 2, S, d): sub-head 2i+c is half c of head i
        a1v, a2v = (attend(q[..., c, :], k[:, :, c], v, c) for c in (0, 1))  # (B, H, T, 2d)
        lam = self.lambda_value(h).to(a1v.dtype).view(1, h, 1, 1)
        out = self.head_norm(a1v - lam * a2v) * (1 - self.lambda_init)  # (B, H, T, 2d)
        if self.head_gate is not None:
            gate = self._my_heads(self.head_gate, h)
            out = out * gate.to(out.dtype).view(1, h, 1, 1)
        return self.wo(self.gated(out.transpose(1, 2).reshape(b, t, h * self.head_dim), x))

"""Multi-head latent attention (MLA; DeepSeek-V2, arXiv 2405.04434, and DeepSeek-V3).

Keys and values come from one low-rank latent per token instead of per-head projections::

    c      = RMSNorm(x W_dkv)                 (kv_rank wide: what the cache keeps)
    k_rope = RoPE(x W_kr)                     (rope_head_dim wide, one for every head)
    k_h    = [c W_uk,h ; k_rope]              v_h = c W_uv,h
    q_h    = [q_nope,h ; RoPE(q_rope,h)]      q = x W_q, or RMSNorm(x W_dq) W_uq (q_rank > 0)

``wkv_a`` holds W_dkv and W_kr stacked (DeepSeek's ``kv_a_proj_with_mqa``), ``wkv_b`` holds
W_uk and W_uv interleaved per head (``kv_b_proj``: each head's nope key rows, then its value
rows), ``wq`` or ``wq_a`` / ``q_norm`` / ``wq_b`` the query path; names as torchtitan's
DeepSeek-V3. Scores scale by 1 / sqrt(nope_head_dim + rope_head_dim), the query's width. The
rotation is kiln's adjacent-pair RoPE over the rope dimensions; DeepSeek's checkpoints lay the
rope dimensions out in pairs (transformers' ``rope_interleave = true``), so their weights load
unpermuted (the output order of a rotation does not change a dot product).

Training expands the latent into per-head keys and values and runs the common ``sdpa``, so the
document mask, sliding windows and context parallelism (which gathers the latent, not the
expanded keys: (kv_rank + rope_head_dim) numbers per token instead of n_heads * (qk + v)) work
as for causal attention.

Generation caches the latent (``cache = "latent"``), not the keys and values: per token and
layer kv_rank + rope_head_dim numbers. A decode step absorbs W_uk into the query and W_uv into
the output (the paper's section 2.1.3): the scores q_nope,h W_uk,h^T c + q_rope,h k_rope are one
multi-query attention of every head over the latents, whose output c-mixtures W_uv,h turns into
each head's value. ``cache = "expanded"`` keeps per-head keys and values instead, as a baseline
for the memory comparison (docs/models.md, "Multi-head latent attention").

Not supported (refused with the key to change): attention sinks, tensor parallelism (the shared
rope key and the latent would need their gradients summed over the ranks' heads).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from kiln.components.attention.context import AttentionContext, sdpa
from kiln.components.attention.kv_cache import (
    KVCache,
    cached_mask,
    cached_sdpa,
    shared_prompt_sdpa,
)
from kiln.components.base import ComponentConfig, Sub, component
from kiln.components.norms.rmsnorm import RMSNorm, RMSNormConfig
from kiln.components.registry import register


class LatentAttentionConfig(ComponentConfig):
    n_heads: int = Field(8, ge=1, description="attention heads")
    kv_rank: int = Field(64, ge=1, description="width of the key/value latent c, what the cache "
                         "keeps per token (DeepSeek's kv_lora_rank; V3: 512)")
    q_rank: int = Field(0, ge=0, description="width of the query latent (q_lora_rank; V3: "
                        "1536); 0 = one full query projection (DeepSeek-V2-Lite)")
    nope_head_dim: int = Field(32, ge=1, description="per-head query/key width without rotation "
                               "(qk_nope_head_dim; V3: 128)")
    rope_head_dim: int = Field(16, ge=2, description="rotated query/key width, the key's part "
                               "shared by every head (qk_rope_head_dim; V3: 64)")
    v_head_dim: int = Field(32, ge=1, description="per-head value width (V3: 128)")
    bias: bool = Field(False, description="biases on wq / wq_a, wkv_a and wo (attention_bias)")
    norm_eps: float = Field(1e-6, gt=0, description="eps of the latent RMSNorms")
    score_scale: float = Field(
        1.0, gt=0, description="multiplies the scores' 1 / sqrt(nope_head_dim + rope_head_dim) "
        "(DeepSeek-V3 under YaRN: (0.1 mscale_all_dim ln(factor) + 1)^2)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the attention probabilities "
                           "while training (0 = off)")
    position: Sub("position") = component("position", "rope", "rotation of the rope dimensions")
    document_mask: bool = Field(
        False, description="training: a token attends only to earlier tokens of its own document")
    positions: Literal["sequence", "per_document"] = Field(
        "sequence", description="training: RoPE positions count from the row's start or restart "
        "at every document (needs document_mask)")
    window: int = Field(0, ge=0, description="sliding-window attention (as causal attention's)")
    mask_kernel: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="kernel of a document mask or context parallel (as causal's)")
    cache: Literal["latent", "expanded"] = Field(
        "latent", description="generation: cache the latent (kv_rank + rope_head_dim per token, "
        "weights absorbed) or per-head keys and values (n_heads * (qk + v) per token)")

    @model_validator(mode="after")
    def _check_positions(self):
        if self.positions == "per_document" and not self.document_mask:
            raise ValueError("positions = \"per_document\" needs document_mask = true")
        return self

    def shape_problem(self, dim: int) -> str | None:
        """Why these widths cannot be built (the model configs ask while reading the recipe)."""
        check = getattr(self.position, "head_dim_problem", None)
        if check is None:
            return None
        return check(self.rope_head_dim, width="attention.rope_head_dim",
                     keys="attention.rope_head_dim")


@register("attention", "latent")
class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3), latent-cached generation."""

    Config = LatentAttentionConfig
    shares_prefix = True  # attention through context.sdpa (attention/shared_prefix.py)
    q_scale: float = 1.0  # µP's query factor (components/models/mup.py), as causal attention's

    def __init__(self, cfg: LatentAttentionConfig, *, dim: int, layer_idx: int, n_layers: int,
                 max_seq_len: int) -> None:
        super().__init__()
        problem = cfg.shape_problem(dim)
        if problem is not None:
            raise ValueError(f"attention: {problem}")
        self.layer_idx = layer_idx
        self.n_heads, self.kv_rank = cfg.n_heads, cfg.kv_rank
        self.nope, self.rope, self.v_dim = cfg.nope_head_dim, cfg.rope_head_dim, cfg.v_head_dim
        self.head_dim = self.nope + self.rope  # the query/key width (scores, µP, FLOPs)
        q_out = self.n_heads * self.head_dim
        if cfg.q_rank:
            self.wq_a = nn.Linear(dim, cfg.q_rank, bias=cfg.bias)
            self.q_norm = RMSNorm(RMSNormConfig(type="rmsnorm", eps=cfg.norm_eps), dim=cfg.q_rank)
            self.wq_b = nn.Linear(cfg.q_rank, q_out, bias=False)
        else:
            self.wq = nn.Linear(dim, q_out, bias=cfg.bias)
        self.wkv_a = nn.Linear(dim, cfg.kv_rank + self.rope, bias=cfg.bias)
        self.kv_norm = RMSNorm(RMSNormConfig(type="rmsnorm", eps=cfg.norm_eps), dim=cfg.kv_rank)
        self.wkv_b = nn.Linear(cfg.kv_rank, self.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(self.n_heads * self.v_dim, dim, bias=cfg.bias)
        self.position = cfg.position.build(head_dim=self.rope, max_seq_len=max_seq_len)
        self.dropout_p = cfg.dropout
        self.window = cfg.window
        self.cache_kind = cfg.cache
        self.score_scale = cfg.score_scale
        self.kv_cache: KVCache | None = None  # set by kv_cache.attach while generating

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Scores (qk wide) and mixing (v wide) over the keys a query sees, times 6 (forward and
        backward, two FLOPs a multiply-add), the causal attention's count."""
        keys = min(seq_len, self.window) if self.window else seq_len
        return 6.0 * self.n_heads * (self.head_dim + self.v_dim) * keys

    def init_weights(self, std: float, out_std: float) -> None:
        ins = [getattr(self, n) for n in ("wq", "wq_a", "wq_b") if hasattr(self, n)]
        for lin, s in [*((m, std) for m in [*ins, self.wkv_a, self.wkv_b]), (self.wo, out_std)]:
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=s)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        for norm in (getattr(self, "q_norm", None), self.kv_norm):
            if norm is not None:
                norm.reset_parameters()
        reset = getattr(self.position, "reset_buffers", None)
        if reset is not None:
            reset()

    def queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, dim) -> the unrotated (B, T, H, nope) and to-be-rotated (B, T, H, rope)
        query parts, times µP's q_scale and ``score_scale``."""
        q = self.wq(x) if hasattr(self, "wq") else self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(*x.shape[:-1], self.n_heads, self.head_dim)
        if self.q_scale * self.score_scale != 1.0:  # linear: the scores scale with it
            q = q * (self.q_scale * self.score_scale)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        return q_nope, q_rope.contiguous()  # (RoPE views pairs of the last dimension)

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, dim) -> the normed latent c (B, T, kv_rank) and the unrotated shared key
        part (B, T, 1, rope)."""
        c, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope], dim=-1)
        return self.kv_norm(c), k_rope.unsqueeze(2).contiguous()

    def expand(self, c: torch.Tensor, k_rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent c (B, S, kv_rank) and rotated k_rope (B, S, 1, rope) -> per-head keys
        (B, S, H, qk) and values (B, S, H, v)."""
        kv = self.wkv_b(c).view(*c.shape[:-1], self.n_heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, -1, self.n_heads, -1)], dim=-1)
        return k, v

    def forward(self, x: torch.Tensor, *,
                context: AttentionContext | None = None) -> torch.Tensor:  # (B, T, dim) -> same
        b, t, _ = x.shape
        q_nope, q_rope = self.queries(x)
        c, k_rope = self.latent(x)
        cache = self.kv_cache
        if cache is not None:
            return self.wo(self._decode(q_nope, q_rope, c, k_rope, cache).reshape(b, t, -1))
        rope_args = {} if context is None else context.rope_args()
        q_rope, k_rope = self.position(q_rope, k_rope, **rope_args)
        if context is not None:  # context parallel: every rank's latents, expanded here
            both = context.gather(torch.cat([c.unsqueeze(2), k_rope], dim=-1))
            c, k_rope = both.squeeze(2).split([self.kv_rank, self.rope], dim=-1)
            k_rope = k_rope.unsqueeze(2)
        k, v = self.expand(c, k_rope)
        q = torch.cat([q_nope, q_rope], dim=-1)
        out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), context,
                   dropout_p=self.dropout_p if self.training else 0.0, window=self.window)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def _decode(self, q_nope, q_rope, c, k_rope, cache: KVCache) -> torch.Tensor:
        """The new tokens' heads' outputs (B, T, H, v) over everything cached."""
        session = cache.session
        q_rope, k_rope = self.position(q_rope, k_rope, positions=session.positions,
                                       limit=session.limit)
        scale = self.head_dim ** -0.5
        if self.cache_kind == "expanded":
            k, v = self.expand(c, k_rope)
            k, v = cache.update(k.transpose(1, 2), v.transpose(1, 2),  # (B, H, S, qk / v)
                                shareable=True)
            q = torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2)
            return cached_sdpa(q, k, v, session, window=self.window,
                               prefix=cache.prefix()).transpose(1, 2)
        # the latent and the rotated shared key, one "head" (B, 1, T, kv_rank + rope)
        (cached,) = cache.update(torch.cat([c, k_rope.squeeze(2)], dim=-1).unsqueeze(1),
                                 shareable=True)
        w = cache.derived.get("wkv_b")  # once per generation: the weights do not change
        if w is None:
            w = cache.derived["wkv_b"] = self._up_weight()
        w = w.view(self.n_heads, self.nope + self.v_dim, self.kv_rank)
        w_uk, w_uv = w.split([self.nope, self.v_dim], dim=1)  # (H, nope, r), (H, v, r)
        q_lat = torch.einsum("bthn,hnr->bhtr", q_nope, w_uk)  # the query seen from the latent
        q = torch.cat([q_lat, q_rope.transpose(1, 2)], dim=-1)  # (B, H, T, r + rope)
        # One latent "head" serves every query head: the heads fold into the query rows (one
        # attention of H * T queries; SDPA's grouped form was 1.7x slower per token on CPU at
        # 1,024 tokens: scripts/mla_cache.py)
        b, h, t, _ = q.shape
        prefix = cache.prefix()  # after a group's shared prompt: its latents (P, 1, L, r + rope)
        rows = q.reshape(b, 1, h * t, -1)
        if prefix is not None:  # (a decode step: T = 1, so the H query rows share a position)
            lat = prefix[0]
            mixed = shared_prompt_sdpa(rows, cached, cached[..., :self.kv_rank],
                                       (lat, lat[..., :self.kv_rank]), session.shared,
                                       self.window, scale=scale)
        else:
            mask = cached_mask(session, self.window)  # (B or 1, 1, T, S), or None
            if mask is not None:
                mask = mask.repeat(1, 1, h, 1)  # row h * T + i: head h's query i
            mixed = F.scaled_dot_product_attention(
                rows, cached, cached[..., :self.kv_rank], attn_mask=mask,
                scale=scale)  # (B, 1, H * T, r): each head's mixture of latents
        return torch.einsum("bhtr,hvr->bthv", mixed.view(b, h, t, -1), w_uv)

    def _up_weight(self) -> torch.Tensor:
        """wkv_b's effective (out, kv_rank) weight: the module applied to the identity, so a
        LoRA / DoRA adapter (a forward hook) or a float8 layer counts as in its forward."""
        eye = torch.eye(self.kv_rank, device=self.wkv_a.weight.device,
                        dtype=self.wkv_a.weight.dtype)
        return self.wkv_b(eye).t()

    def score_inputs(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """q and k (B, H, T, qk) as the training forward hands them to SDPA (``logit_stats``)."""
        q_nope, q_rope = self.queries(x)
        c, k_rope = self.latent(x)
        q_rope, k_rope = self.position(q_rope, k_rope)
        k, _ = self.expand(c, k_rope)
        return [(torch.cat([q_nope, q_rope], dim=-1).transpose(1, 2), k.transpose(1, 2))]


def cache_numbers_per_token(attn: LatentAttention) -> dict[str, int]:
    """What one token costs the cache of one layer, in numbers: latent or expanded."""
    return {"latent": attn.kv_rank + attn.rope,
            "expanded": attn.n_heads * (attn.head_dim + attn.v_dim)}

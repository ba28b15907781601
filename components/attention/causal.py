"""Causal multi-head self-attention with grouped-query heads (GQA), RoPE and optional QK-norm.

Parameter names follow torchtitan's llama3 of the TOML era (v0.2.x: ``wq``, ``wk``, ``wv``,
``wo``). torchtitan 0.3.0 renamed them (``attention.qkv_linear.wq``, ``lm_head``). While
generating, a ``kv_cache`` (``kv_cache.py``) makes a forward run only the new tokens. Layout is
(B, T, H, D) through the projections and the
position encoding; SDPA sees (B, H, T, D) as a free transpose and returns a tensor whose memory
is already (B, T, H, D), so no `.contiguous()` copy is made on the way in or out.

The fused ``wqkv`` rows are grouped by key/value head (torchtitan's ``FusedQKVLinear``, Megatron's
layout): for each kv head, its ``n_heads / n_kv_heads`` query heads, then its key, then its value
(``split_fused_qkv``). A contiguous slice of whole kv groups is then a self-contained set of
heads, so tensor parallelism shards ``wqkv`` row-wise like ``wq`` (``kiln.parallelisms``).

Head counts in ``forward`` come from the tensor shapes, not the config: under tensor parallelism a
rank sees only its heads (the projections return local shards).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from kiln.components import distributed
from kiln.components.attention.context import AttentionContext, sdpa
from kiln.components.attention.kv_cache import KVCache, cached_sdpa
from kiln.components.base import ComponentConfig, Sub, component
from kiln.components.norms.rmsnorm import RMSNorm, RMSNormConfig
from kiln.components.registry import register


class CausalAttentionConfig(ComponentConfig):
    n_heads: int = Field(16, ge=1, description="query heads (head_dim = dim / n_heads unless set)")
    n_kv_heads: int = Field(
        0, ge=0, description="key/value heads (0 = n_heads; fewer = grouped-query attention)"
    )
    qk_norm: bool = Field(False, description="per-head RMSNorm on q and k, before the rotation")
    fused_qkv: bool = Field(
        False, description="one `wqkv` Linear instead of wq/wk/wv (a different checkpoint layout)"
    )
    bias: bool = Field(False, description="biases on the q/k/v/o projections")
    qkv_bias: bool = Field(False, description="biases on q/k/v only (Qwen2); o stays bias-free")
    head_dim: int = Field(0, ge=0, description="width of a head (0 = dim / n_heads)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the attention probabilities "
                           "while training (GPT-2: 0.1; 0 = off)")
    qk_norm_eps: float = Field(1e-5, gt=0, description="eps of the QK-norm RMSNorms")
    position: Sub("position") = component("position", "rope", "position encoding of q and k")
    document_mask: bool = Field(
        False, description="training: a token attends only to earlier tokens of its own document "
        "(packed rows; the batch's doc_ids, given by every built-in dataset)")
    positions: Literal["sequence", "per_document"] = Field(
        "sequence", description="training: RoPE positions count from the row's start (sequence) "
        "or restart at every document (per_document; needs document_mask)")
    window: int = Field(
        0, ge=0, description="sliding-window attention: a query sees itself and the window - 1 "
        "tokens before it (Mistral's sliding_window; 0 = every earlier token); with "
        "model.layer_types, only the \"sliding\" layers")
    output_gate: bool = Field(
        False, description="Qwen3-Next's gated attention: the heads' output times "
        "sigmoid(wg x), one gate per output element, before wo")
    sinks: bool = Field(
        False, description="learned attention sinks (gpt-oss): a logit per head joins every "
        "query's softmax as a key with no value, so a head can attend to nothing")
    mask_kernel: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="kernel of a document mask or context parallel: sdpa (a dense "
        "mask, any device), flex (FlexAttention block mask, CUDA), auto = flex on CUDA, sdpa "
        "elsewhere")

    @model_validator(mode="after")
    def _check_positions(self):
        if self.positions == "per_document" and not self.document_mask:
            raise ValueError("positions = \"per_document\" needs document_mask = true (the "
                             "positions restart where the mask starts a new document)")
        return self

    def heads_problem(self, dim: int) -> str | None:
        """Why these head counts do not fit a model of width ``dim`` (None: they fit)."""
        n_kv = self.n_kv_heads or self.n_heads
        if not self.head_dim and dim % self.n_heads:
            fits = _nearest_divisors(dim, self.n_heads)
            return (f"dim = {dim} is not a multiple of attention.n_heads = {self.n_heads} (each "
                    f"head is dim / n_heads wide): set attention.n_heads to one that divides "
                    f"{dim} (nearest: {fits}) or set attention.head_dim")
        if self.n_heads % n_kv:
            return (f"attention.n_heads = {self.n_heads} is not a multiple of "
                    f"attention.n_kv_heads = {n_kv} (each key/value head serves a whole group "
                    "of query heads): change one of them")
        return None

    def shape_problem(self, dim: int) -> str | None:
        """Why this attention cannot be built in a model of width ``dim`` (None: it can). The
        model configs ask while the recipe is read, so a bad shape is a recipe error naming
        the keys, not a traceback from the build."""
        problem = self.heads_problem(dim)
        check = getattr(self.position, "head_dim_problem", None)
        if problem is None and check is not None:
            problem = check(self.head_dim or dim // self.n_heads)
        return problem


def _nearest_divisors(dim: int, n: int) -> str:
    """The divisors of ``dim`` just below and above ``n`` ("4 or 8")."""
    below = max(d for d in range(1, n) if dim % d == 0)
    above = [d for d in range(n + 1, dim + 1) if dim % d == 0]
    return f"{below} or {above[0]}" if above else str(below)


@register("attention", "causal")
class CausalAttention(nn.Module):
    """Causal self-attention (SDPA) with GQA, RoPE and optional QK-norm, torchtitan v0.2 names."""

    Config = CausalAttentionConfig
    # rows packed around a shared prompt attend through the context (attention/shared_prefix.py)
    shares_prefix = True
    # A factor on the queries (after QK-norm): the score scale becomes q_scale / sqrt(head_dim).
    # 1 except under µP with a base head width (components/models/mup.py sets it).
    q_scale: float = 1.0

    def __init__(
        self, cfg: CausalAttentionConfig, *, dim: int, layer_idx: int, n_layers: int,
        max_seq_len: int,
    ) -> None:
        super().__init__()
        problem = cfg.shape_problem(dim)
        if problem is not None:
            raise ValueError(f"attention: {problem}")
        n_kv = cfg.n_kv_heads or cfg.n_heads
        self.layer_idx = layer_idx
        self.n_heads = cfg.n_heads
        self.n_kv_heads = n_kv
        self.head_dim = cfg.head_dim or dim // cfg.n_heads
        q_dim, kv_dim = self.n_heads * self.head_dim, n_kv * self.head_dim
        in_bias = cfg.bias or cfg.qkv_bias
        if cfg.fused_qkv:
            self.wqkv = nn.Linear(dim, q_dim + 2 * kv_dim, bias=in_bias)
        else:
            self.wq = nn.Linear(dim, q_dim, bias=in_bias)
            self.wk = nn.Linear(dim, kv_dim, bias=in_bias)
            self.wv = nn.Linear(dim, kv_dim, bias=in_bias)
        self.wo = nn.Linear(q_dim, dim, bias=cfg.bias)
        if cfg.output_gate:  # after wo in the parameter order: models without it keep theirs
            self.wg = nn.Linear(dim, q_dim, bias=in_bias)
        if cfg.qk_norm:
            norm_cfg = RMSNormConfig(type="rmsnorm", eps=cfg.qk_norm_eps)
            self.q_norm = RMSNorm(norm_cfg, dim=self.head_dim)
            self.k_norm = RMSNorm(norm_cfg, dim=self.head_dim)
        else:
            self.q_norm = self.k_norm = None
        self.position = cfg.position.build(head_dim=self.head_dim, max_seq_len=max_seq_len)
        self.dropout_p = cfg.dropout
        self.window = cfg.window  # 0: full causal (the model sets it per layer: layer_types)
        # (H,); whole on every rank: tensor parallel, which would split the heads, refuses them
        self.sinks = nn.Parameter(torch.zeros(self.n_heads)) if cfg.sinks else None
        self.kv_cache: KVCache | None = None  # set by kv_cache.attach while generating

    def normed(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k after QK-norm, q times µP's ``q_scale`` (RoPE, linear, commutes with it)."""
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return (q * self.q_scale if self.q_scale != 1.0 else q), k

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Scores and mixing: 12 * H * D per key a query sees (the full square's T, or the
        window of a sliding-window layer), as the model's MFU counts them."""
        keys = min(seq_len, self.window) if self.window else seq_len
        return 12.0 * self.n_heads * self.head_dim * keys

    def init_weights(self, std: float, out_std: float) -> None:
        """Inputs projections ~ N(0, std), output projection ~ N(0, out_std), biases 0."""
        ins = [self.wqkv] if hasattr(self, "wqkv") else [self.wq, self.wk, self.wv]
        gate = [self.wg] if hasattr(self, "wg") else []
        for lin, s in [*((m, std) for m in [*ins, *gate]), (self.wo, out_std)]:
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=s)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        if self.sinks is not None:
            nn.init.normal_(self.sinks, mean=0.0, std=std)  # as transformers' gpt-oss
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.reset_parameters()
        reset = getattr(self.position, "reset_buffers", None)
        if reset is not None:
            reset()

    def forward(self, x: torch.Tensor, *,
                context: AttentionContext | None = None) -> torch.Tensor:  # (B, T, dim) -> same
        """``context``: document mask / context parallel of a training forward
        (``attention/context.py``); None = causal over ``x``'s tokens."""
        b, t, _ = x.shape
        cache = self.kv_cache
        # (B, T, Hq, D), (B, T, Hk, D), (B, T, Hk, D)
        q, k, v = self.project_qkv(x) if cache is None else self._decode_qkv(x, cache)
        q, k = self.normed(q, k)
        if cache is None:
            if context is None:
                q, k = self.position(q, k)
            else:  # rotated at their positions; context parallel: every rank's keys and values
                q, k = self.position(q, k, **context.rope_args())
                k, v = context.gather(k), context.gather(v)  # (B, T_all, Hk, D)
            # SDPA wants (B, H, T, D); a transpose is a view.
            out = sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), context,
                       dropout_p=self.dropout_p if self.training else 0.0, window=self.window,
                       sinks=self.sinks)
        else:  # decoding: new tokens at their own positions, keys/values of earlier ones cached
            session = cache.session
            q, k = self.position(q, k, positions=session.positions, limit=session.limit)
            k, v = cache.update(k.transpose(1, 2), v.transpose(1, 2), shareable=True)
            out = cached_sdpa(q.transpose(1, 2), k, v, session, window=self.window,
                              sinks=self.sinks, prefix=cache.prefix())
        # out: (B, Hq, T, D), its memory laid out as (B, T, Hq, D), so this reshape is a view.
        return self.wo(self.gated(out.transpose(1, 2).reshape(b, t, -1), x))

    def gated(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The heads' output (B, T, H * D) times sigmoid(wg x) with output_gate, else as is."""
        gate = getattr(self, "wg", None)
        return out if gate is None else out * torch.sigmoid(gate(x))

    def score_inputs(self, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """q (B, Hq, T, D) and k (B, Hk, T, D) as the training forward hands them to SDPA
        (``logit_stats``: diagnostics recompute the attention logits from them)."""
        q, k, _ = self.project_qkv(x)
        q, k = self.normed(q, k)
        q, k = self.position(q, k)
        return [(q.transpose(1, 2), k.transpose(1, 2))]

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, dim) -> q (B, T, Hq, D), k and v (B, T, Hk, D) (this rank's heads)."""
        hd = self.head_dim
        if hasattr(self, "wqkv"):
            return split_fused_qkv(self.wqkv(x), self.n_heads // self.n_kv_heads, hd)
        # view, not unflatten: Tensor.unflatten is a Python wrapper, 3 calls per layer per token
        # while decoding (the same op)
        return tuple(lin(x).view(*x.shape[:-1], -1, hd) for lin in (self.wq, self.wk, self.wv))

    def _decode_qkv(self, x: torch.Tensor, cache: KVCache):
        """``project_qkv`` while decoding: one matmul against wq, wk and wv stacked. A decode step
        multiplies one row per sequence, so at small widths each projection costs its dispatch
        more than its arithmetic (dim 256, batch 1: three calls 5% slower per token than one).
        The stacked copy lives in the cache for one generation; it is made only for small
        matrices (at most ``_STACK_BYTES``; larger ones are bound by reading the weights, and
        the copy would cost memory) of a single process (FSDP / TP hold shards), and only of
        plain layers: an adapter's forward hook or a float8 layer computes more than the weight,
        so those layers are called as in training."""
        stacked = cache.derived.get("qkv")
        if stacked is None:
            stacked = cache.derived["qkv"] = self._stacked_qkv()
        if stacked is False:
            return self.project_qkv(x)
        weight, bias = stacked
        out = F.linear(x, weight, bias).view(*x.shape[:-1], -1, self.head_dim)
        return out.split([self.n_heads, self.n_kv_heads, self.n_kv_heads], dim=-2)

    def _stacked_qkv(self):
        """(weight, bias) of wq, wk, wv stacked by rows, or False where not worth it."""
        if hasattr(self, "wqkv"):
            group, lins = self.n_heads // self.n_kv_heads, (self.wqkv,)
            parts = [split_fused_rows(self.wqkv.weight, group, self.head_dim)]
            if self.wqkv.bias is not None:
                parts.append(split_fused_rows(self.wqkv.bias, group, self.head_dim))
        else:
            lins = (self.wq, self.wk, self.wv)
            parts = [[lin.weight for lin in lins]]
            if self.wq.bias is not None:
                parts.append([lin.bias for lin in lins])
        if not all(_plain(lin) for lin in lins):
            return False
        weights = parts[0]
        size = sum(w.numel() * w.element_size() for w in weights)
        if distributed.is_initialized() or size > _STACK_BYTES:  # (DTensors need a process group)
            return False
        stacked = [torch.cat([p.detach() for p in ps]) for ps in parts]
        return stacked[0], stacked[1] if len(stacked) > 1 else None


def _plain(lin: nn.Module) -> bool:
    """Whether ``lin(x)`` is ``F.linear(x, lin.weight, lin.bias)``: an ``nn.Linear`` itself (a
    float8 subclass casts) with no hooks (an adapter's forward hook adds its update)."""
    return type(lin) is nn.Linear and not lin._forward_hooks and not lin._forward_pre_hooks


# Decode-time stacking of q/k/v projections up to this size (all three matrices together).
_STACK_BYTES = 4 << 20


def split_fused_qkv(
    qkv: torch.Tensor, group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused activations (..., Hk * (group + 2) * D), kv-grouped layout -> q (..., Hq, D),
    k (..., Hk, D), v (..., Hk, D) with Hq = group * Hk (query head i uses kv head i // group,
    as SDPA's ``enable_gqa`` expects)."""
    grouped = qkv.unflatten(-1, (-1, group + 2, head_dim))  # (..., Hk, group + 2, D)
    q, k, v = grouped.split([group, 1, 1], dim=-2)
    return q.flatten(-3, -2), k.squeeze(-2), v.squeeze(-2)


def split_fused_rows(
    w: torch.Tensor, group: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of a fused ``wqkv`` weight (or bias) as the rows of separate wq, wk, wv."""
    grouped = w.unflatten(0, (-1, group + 2, head_dim))  # (Hk, group + 2, D, ...)
    q, k, v = grouped.split([group, 1, 1], dim=1)
    return q.flatten(0, 2), k.flatten(0, 2), v.flatten(0, 2)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int,
             head_dim: int) -> torch.Tensor:
    """The inverse of ``split_fused_rows``: rows of wq, wk, wv (or biases) -> wqkv rows."""
    hk = k.shape[0] // head_dim
    parts = (q.unflatten(0, (hk, group, head_dim)), k.unflatten(0, (hk, 1, head_dim)),
             v.unflatten(0, (hk, 1, head_dim)))
    return torch.cat(parts, dim=1).flatten(0, 2)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA on (B, H, T, D) with GQA (``context.sdpa`` without a context)."""
    return sdpa(q, k, v)

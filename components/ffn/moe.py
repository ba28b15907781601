"""Mixture-of-experts feed-forward with aux-loss-free load balancing (DeepSeek-V3).

Routing: scores = softmax or sigmoid of a linear router (computed in fp32); the top-k experts
are chosen on ``scores + expert_bias`` (with ``n_groups``, within the token's ``topk_groups``
groups of best top-2 biased sums; the others -inf, as DeepSeek-V3's reference code), but the
gate weights come from the unbiased scores (optionally renormalised over the k chosen, times
``route_scale``). The bias is a buffer moved outside the gradient: once per *global* step, by
``coeff * sign(mean - load)`` (re-centred), with the loads of the whole step (every
micro-batch, loop and segment) summed over every rank that saw tokens (data-parallel ranks,
tensor-parallel sequence slices); a step with a skipped optimizer step (any segment, under
segmented BPTT) discards the loads and leaves the bias alone, as the looped-MoE reference does.
An optional sequence-wise auxiliary loss (DeepSeek-V3 eq. 17-20) is collected by the model
(``moe_model.pop_aux_loss``). Expert loads, their entropy and dropped assignments:
``moe_model.moe_metrics``.

Experts are SwiGLUs with stacked weights (``w1``/``w3`` (E, dim, hidden), ``w2`` (E, hidden,
dim)), or gpt-oss's (``experts``); dispatch lives in ``moe_dispatch``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn

from kiln.components import distributed
from kiln.components.base import ComponentConfig
from kiln.components.ffn.moe_all_to_all import run_experts_all_to_all
from kiln.components.ffn.moe_dispatch import (
    run_experts,
    run_gpt_oss_experts,
    sort_by_expert,
)
from kiln.components.ffn.swiglu import SwiGLU, SwiGLUConfig
from kiln.components.registry import register


class MoEConfig(ComponentConfig):
    n_experts: int = Field(8, ge=1, description="routed experts E")
    top_k: int = Field(2, ge=1, description="experts per token")
    hidden_dim: int = Field(
        0, ge=0, description="hidden width of each expert (0 = Llama rule 8*dim/3 divided by "
        "top_k, rounded up to multiple_of: active FFN FLOPs of a dense layer)"
    )
    multiple_of: int = Field(16, ge=1, description="round the derived hidden width up to this")
    score: Literal["softmax", "sigmoid"] = Field("softmax", description="router score function")
    renormalize: bool = Field(
        True, description="gates of the k chosen experts sum to 1 (top_k > 1 only: with "
        "top_k = 1 the gate stays the expert's score, since a gate of 1 would give the router "
        "no gradient)"
    )
    route_scale: float = Field(1.0, gt=0, description="multiplies the gate weights")
    experts: Literal["swiglu", "gpt_oss"] = Field(
        "swiglu", description="expert kind: swiglu (w1, w3, w2, no biases) or gpt_oss "
        "(gpt-oss's: gate and up interleaved in one biased w13, gate clamped at swiglu_limit, "
        "(up + 1) * gate * sigmoid(swiglu_alpha * gate), a biased w2)")
    swiglu_limit: float = Field(7.0, gt=0, description="gpt_oss experts: the clamp of gate "
                                "(above) and up (both sides)")
    swiglu_alpha: float = Field(1.702, gt=0, description="gpt_oss experts: the sigmoid's slope")
    router_bias: bool = Field(False, description="a bias on the router's logits (gpt-oss)")
    n_groups: int = Field(
        1, ge=1, description="group-limited routing (DeepSeek-V3's n_group: 8): experts in this "
        "many equal groups, a token routed within its topk_groups best groups only")
    topk_groups: int = Field(
        1, ge=1, description="groups a token may use (DeepSeek-V3's topk_group: 4); a group "
        "scores the sum of its two best experts' biased scores")
    n_shared_experts: int = Field(0, ge=0, description="always-on shared experts (one SwiGLU)")
    shared_hidden_dim: int = Field(
        0, ge=0, description="hidden width of the shared expert (0 = n_shared * hidden_dim)"
    )
    shared_gate: bool = Field(
        False, description="the shared expert's output times sigmoid(w x), one gate per token "
        "(Qwen2-MoE / Qwen3-Next's shared_expert_gate)")
    bias_update_coeff: float = Field(
        1e-3, ge=0, description="aux-loss-free balancing: bias step per optimizer step (0 = off; "
        "an adapter run, whose router is frozen, leaves the bias as loaded)")
    aux_loss_coeff: float = Field(
        0.0, ge=0, description="sequence-wise balance loss weight alpha (0 = off)"
    )
    capacity_factor: float = Field(
        0.0, ge=0, description="drop assignments beyond ceil(cf*N*k/E) per expert (0 = none)"
    )
    dispatch: Literal["auto", "grouped", "loop"] = Field(
        "auto", description="expert kernel: torch._grouped_mm, a per-expert loop, or auto"
    )

    @model_validator(mode="after")
    def _check(self) -> MoEConfig:
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) exceeds n_experts ({self.n_experts})")
        if self.n_groups > 1:
            per = self.n_experts // self.n_groups
            if self.n_experts % self.n_groups or per < 2:
                raise ValueError(f"n_groups = {self.n_groups} must split n_experts = "
                                 f"{self.n_experts} into equal groups of at least 2 experts")
            if self.topk_groups > self.n_groups or self.top_k > self.topk_groups * per:
                raise ValueError(f"topk_groups = {self.topk_groups} of {self.n_groups} groups "
                                 f"of {per} experts cannot hold top_k = {self.top_k}: raise "
                                 "topk_groups or lower top_k")
        elif self.topk_groups != 1:
            raise ValueError("topk_groups needs n_groups > 1 (group-limited routing)")
        if self.shared_gate and not self.n_shared_experts:
            raise ValueError("shared_gate gates the shared expert: set n_shared_experts >= 1")
        return self


def expert_hidden_dim(cfg: MoEConfig, dim: int) -> int:
    if cfg.hidden_dim:
        return cfg.hidden_dim
    h = int(2 * (4 * dim) / 3) // cfg.top_k
    return cfg.multiple_of * ((h + cfg.multiple_of - 1) // cfg.multiple_of)


def _in_backward() -> bool:
    # Activation checkpointing re-runs forward inside backward; those calls must not count
    # tokens twice (torchtitan halves the counts instead, which assumes full recompute).
    return torch._C._current_graph_task_id() != -1


class Router(nn.Linear):
    """The router: an ``nn.Linear`` whose logits are computed in fp32 whatever the weight's and
    the input's dtype (under autocast too). Called as a module, so an adapter's forward hook
    on it (a LoRA target) adds its update, in the input's dtype, to the fp32 logits; float8
    leaves it alone (``parallelisms/float8.py`` converts plain ``nn.Linear`` layers only)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)


@register("ffn", "moe")
class MoE(nn.Module):
    """Top-k routed SwiGLU experts (+ optional shared expert), aux-loss-free bias balancing."""

    Config = MoEConfig
    # routing counts the batch's tokens (balance loss, capacity): rows may not share a prompt
    shares_prefix = False
    prefix_problem = "its routing counts the batch's tokens (balance loss, expert bias)"
    counts_batch_tokens = True  # padding columns count too (step_context.padding_cut)

    def __init__(self, cfg: MoEConfig, *, dim: int, layer_idx: int, n_layers: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.dim, self.layer_idx = dim, layer_idx
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.hidden_dim = expert_hidden_dim(cfg, dim)
        e, f = cfg.n_experts, self.hidden_dim
        self.router = Router(dim, e, bias=cfg.router_bias)
        if cfg.experts == "gpt_oss":  # transformers' GptOssExperts layout, columns interleaved
            self.w13 = nn.Parameter(torch.empty(e, dim, 2 * f))  # gate, up, gate, up, ...
            self.b13 = nn.Parameter(torch.empty(e, 2 * f))
            self.w2 = nn.Parameter(torch.empty(e, f, dim))
            self.b2 = nn.Parameter(torch.empty(e, dim))
        else:
            self.w1 = nn.Parameter(torch.empty(e, dim, f))  # gate, (E, D, F)
            self.w3 = nn.Parameter(torch.empty(e, dim, f))  # up, (E, D, F)
            self.w2 = nn.Parameter(torch.empty(e, f, dim))  # down, (E, F, D)
        self.shared = None
        if cfg.n_shared_experts:
            hidden = cfg.shared_hidden_dim or cfg.n_shared_experts * f
            self.shared = SwiGLU(SwiGLUConfig(type="swiglu", hidden_dim=hidden), dim=dim,
                                 layer_idx=layer_idx, n_layers=n_layers)
        if cfg.shared_gate:
            self.shared_gate = nn.Linear(dim, 1, bias=False)
        # Balancing state: the bias is part of the model (checkpointed); the loads are per step.
        self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))
        self.register_buffer("tokens_per_expert", torch.zeros(e, dtype=torch.float32),
                             persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.float32), persistent=False)
        self.register_buffer("last_load", torch.zeros(e, dtype=torch.float32), persistent=False)
        self.register_buffer("last_dropped", torch.zeros((), dtype=torch.float32),
                             persistent=False)
        self.aux_loss: torch.Tensor | None = None  # summed over calls until popped
        # Expert parallel (set by kiln.parallelisms.expert_parallel): w1/w3/w2 are then DTensors
        # sharded by expert over ``ep`` ranks of ``expert_group``, and rows travel all-to-all.
        self.expert_group, self.ep = None, 1
        if not self.w2.is_meta:
            self.init_weights(0.02, 0.02)

    @torch.no_grad()
    def init_weights(self, std: float, out_std: float) -> None:
        """Router, w1, w3 ~ N(0, std); w2 (writes the residual stream) ~ N(0, out_std)."""
        nn.init.trunc_normal_(self.router.weight, std=std)
        ins = [self.w13] if hasattr(self, "w13") else [self.w1, self.w3]
        for w, s in [*((w, std) for w in ins), (self.w2, out_std)]:
            nn.init.trunc_normal_(w, std=s)
        for bias in (self.router.bias, getattr(self, "b13", None), getattr(self, "b2", None)):
            if bias is not None:
                nn.init.zeros_(bias)
        if self.shared is not None:
            self.shared.init_weights(std, out_std)
        if hasattr(self, "shared_gate"):
            nn.init.trunc_normal_(self.shared_gate.weight, std=std)
        self.expert_bias.zero_()
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Zero the per-step counters (derived state, not checkpointed), e.g. after to_empty."""
        for buf in (self.tokens_per_expert, self.dropped, self.last_load, self.last_dropped):
            buf.zero_()

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> (chosen experts (N, k) long, gate weights (N, k) fp32, scores (N, E))."""
        logits = self.router(x)  # (N, E) fp32
        scores = logits.softmax(-1) if self.cfg.score == "softmax" else logits.sigmoid()
        # The bias only picks the experts; the gates are the unbiased scores.
        choice = scores.detach() + self.expert_bias  # (N, E)
        groups = self.cfg.n_groups
        if groups > 1:  # only the experts of each token's topk_groups best groups compete
            by_group = choice.view(choice.shape[0], groups, -1)  # (N, G, E / G)
            best = by_group.topk(2, dim=-1).values.sum(-1)  # (N, G)
            kept = best.topk(self.cfg.topk_groups, dim=-1).indices
            allowed = torch.zeros_like(best, dtype=torch.bool).scatter_(1, kept, True)
            choice = by_group.masked_fill(~allowed[..., None], float("-inf")).flatten(1)
        _, idx = torch.topk(choice, self.top_k, dim=-1)  # (N, k)
        gates = scores.gather(-1, idx)  # (N, k)
        if self.cfg.renormalize and self.top_k > 1:
            gates = gates / gates.sum(-1, keepdim=True).clamp_min(1e-20)
        return idx, gates * self.cfg.route_scale, scores

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, T, D)
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D)
        n, k = flat.shape[0], self.top_k
        idx, gates, scores = self.route(flat)
        order, counts = sort_by_expert(idx.reshape(-1), self.n_experts)  # (N*k,), (E,)
        if self.cfg.capacity_factor:
            gates = gates * self._capacity_mask(order, counts, n).view(n, k)
        if self.training and not _in_backward():
            with torch.no_grad():
                self.tokens_per_expert += counts.float()
        token = order // k  # (N*k,) the token of each sorted assignment
        # index_select / index_add_ rather than indexing: their backward passes are a gather and
        # a scatter-add, where flat[token] would backpropagate through a serial index_put
        xs = flat.index_select(0, token)  # (N*k, D) rows sorted by expert
        if hasattr(self, "w13"):
            c = self.cfg
            ys = run_gpt_oss_experts(c.dispatch, xs, self.w13, self.b13, self.w2, self.b2,
                                     counts, c.swiglu_limit, c.swiglu_alpha)
        elif self.ep > 1:
            w1, w3, w2 = (w.to_local() for w in (self.w1, self.w3, self.w2))  # my experts
            ys = run_experts_all_to_all(self.cfg.dispatch, xs, counts, w1, w3, w2,
                                        self.expert_group, self.ep)
        else:
            ys = run_experts(self.cfg.dispatch, xs, self.w1, self.w3, self.w2, counts)  # (N*k, D)
        # Combine: each sorted row times its gate, summed into its token (7% faster than
        # unsorting into (N, k, D) and a k-deep bmm, forward + backward on CPU)
        weighted = ys * gates.reshape(-1)[order].to(ys.dtype)[:, None]  # (N*k, D)
        out = ys.new_zeros(n, ys.shape[-1]).index_add_(0, token, weighted)  # (N, D)
        if self.shared is not None:
            shared = self.shared(flat)
            if hasattr(self, "shared_gate"):
                shared = shared * torch.sigmoid(self.shared_gate(flat))
            out = out + shared.to(out.dtype)
        if self.cfg.aux_loss_coeff and self.training:
            # An activation-checkpoint recompute runs the same ops (it must save the same
            # tensors) but does not collect the loss again: the forward's copy is already in
            # the graph, and a second one would be added to the next micro-batch's loss.
            aux = self._sequence_aux_loss(idx, scores, shape)
            if not _in_backward():
                self.aux_loss = aux if self.aux_loss is None else self.aux_loss + aux
        return out.view(shape).to(x.dtype)

    def _capacity_mask(self, order: torch.Tensor, counts: torch.Tensor, n: int) -> torch.Tensor:
        """1 for kept assignments, 0 for those beyond an expert's capacity (in sorted order)."""
        # an expert holds at most the n tokens: a larger capacity drops nothing (and
        # capacity_factor = 1e30 overflowed the comparison below)
        cap = math.ceil(min(self.cfg.capacity_factor * n * self.top_k / self.n_experts, n))
        starts = torch.cumsum(counts, 0) - counts  # (E,)
        ranks = torch.arange(order.numel(), device=order.device)
        sorted_experts = torch.repeat_interleave(
            torch.arange(self.n_experts, device=order.device), counts)  # (N*k,)
        keep_sorted = (ranks - starts[sorted_experts]) < cap
        keep = torch.empty_like(keep_sorted)
        keep[order] = keep_sorted
        if self.training and not _in_backward():
            with torch.no_grad():
                self.dropped += (~keep).sum().float()
        return keep.float()

    def _sequence_aux_loss(self, idx: torch.Tensor, scores: torch.Tensor, shape) -> torch.Tensor:
        """alpha * sum_i f_i * P_i per sequence, averaged (DeepSeek-V3 sequence-wise loss)."""
        b, t, e, k = shape[0], shape[1], self.n_experts, self.top_k
        probs = scores / scores.sum(-1, keepdim=True)  # (N, E) normalised affinities
        p = probs.view(b, t, e).mean(1)  # (B, E)
        hits = torch.zeros(b, e, device=idx.device).scatter_add_(
            1, idx.view(b, t * k), torch.ones(b, t * k, device=idx.device))  # (B, E)
        f = hits * (e / (k * t))
        return self.cfg.aux_loss_coeff * (f * p).sum(-1).mean()

    @torch.no_grad()
    def apply_load(self, load: torch.Tensor) -> None:
        """Move the bias toward balance given this step's global loads (E,); reset counts. A
        frozen router (an adapter run: the base is frozen, its routing bias part of it) keeps
        its bias: the run's checkpoints and its peft export hold the adapters alone."""
        self.last_load.copy_(load)
        self.last_dropped.copy_(self.dropped)
        coeff = self.cfg.bias_update_coeff if self.router.weight.requires_grad else 0.0
        if coeff and load.sum() > 0:
            delta = coeff * torch.sign(load.mean() - load)
            self.expert_bias += delta - delta.mean()  # re-centred
        self.discard_load()

    @torch.no_grad()
    def discard_load(self) -> None:
        self.tokens_per_expert.zero_()
        self.dropped.zero_()

    def on_global_step(self, skipped: bool) -> None:
        balance_step([self], skipped)

    def active_params(self) -> int:
        """Parameters one token uses: router, k of E experts, the shared expert."""
        stacks = [getattr(self, n) for n in ("w1", "w3", "w13", "b13", "w2", "b2")
                  if hasattr(self, n)]
        per_expert = sum(math.prod(w.shape[1:]) for w in stacks)
        shared = sum(p.numel() for p in self.shared.parameters()) if self.shared else 0
        if hasattr(self, "shared_gate"):
            shared += self.shared_gate.weight.numel()
        router = sum(p.numel() for p in self.router.parameters())
        return router + self.top_k * per_expert + shared

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, experts={self.n_experts}, top_k={self.top_k}, "
                f"hidden={self.hidden_dim}, score={self.cfg.score}")


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def idle_expert_params(module: nn.Module) -> int:
    """Parameters of ``module``'s MoE layers that one token does not use (E - k routed
    experts): subtract them from a parameter count to get the active parameters."""
    return sum(sum(p.numel() for p in m.parameters()) - m.active_params()
               for m in moe_layers(module))


@torch.no_grad()
def balance_step(layers: list[MoE], skipped: bool, group=None) -> None:
    """After a global step: sum every layer's loads over all ranks in one all-reduce (each rank
    counted its own tokens: its data-parallel batch, its tensor-parallel sequence slice) and
    move the biases; on a skipped step drop the loads instead. Every rank takes the same
    decision, so the collective is called by all or none. ``group``: the ranks holding these
    layers (a pipeline stage's; default all)."""
    if not layers:
        return
    if skipped:
        for layer in layers:
            layer.discard_load()
        return
    loads = torch.stack([layer.tokens_per_expert for layer in layers])  # (L, E)
    distributed.all_reduce_(loads, group=group)
    for layer, load in zip(layers, loads, strict=True):
        layer.apply_load(load)

"""The looped (recurrent-depth) decoder: prelude -> a block stack applied H times -> coda -> head.

    e = prelude(embed(ids))                        # (B, T, dim), computed once per forward
    s_0 = carry or init                            # zeros / e / N(0, init_std)
    s_i = core(inject(lambda * s_{i-1}, e))        # i = 1..H; inject: add, or adapter(cat)
    logits = head(norm(coda(s_H)))

The same weights evaluate at any loop count ``H_eff <= H`` (``forward(ids, loops=h)``: early
exit, the coda reads s_h). The loop residual scale ``lambda`` is fixed, learned (``lambda_max *
sigmoid(loop_scale_raw)``, so it stays in (0, lambda_max)) or scheduled linearly over training
(``set_progress``). Segmented BPTT runs loops [start, stop) from a given state through
``loop_window``; the carry (``carry_state``) is the per-sample state after the last loop of a
training step, used as s_0 of the same micro-batch row in the next step. See ``looped_carry``.

Blocks, sub-component configs and the init protocol are the transformer's (``block.py``); the
block list is ``layers`` ("0".."n-1": prelude, then recurrent, then coda).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from kiln.components.attention.context import AttentionContext
from kiln.components.base import ComponentConfig, Sub, component
from kiln.components.distributed import is_dtensor
from kiln.components.ffn.moe import idle_expert_params
from kiln.components.ffn.moe_model import MoEModelMixin
from kiln.components.models.block import (
    RetiedOnEmpty,
    build_blocks,
    check_block_shapes,
    init_blocks,
    init_component,
    resolve_sizes,
)
from kiln.components.models.lm_head import HeadFn, head_operands, logits
from kiln.components.models.looped_carry import Carry, LoopWindow
from kiln.components.protocols import ModelContract
from kiln.components.registry import register


class LoopedConfig(ComponentConfig):
    dim: int = Field(256, ge=1, description="model (residual stream) width")
    n_prelude: int = Field(1, ge=0, description="blocks before the loop (run once)")
    n_recurrent: int = Field(2, ge=1, description="blocks of the looped core")
    n_coda: int = Field(1, ge=0, description="blocks after the loop (run once per forward)")
    loops: int = Field(4, ge=1, description="H: applications of the core per forward")
    vocab_size: int = Field(
        0, ge=0, description="0 = the tokenizer's vocabulary size rounded up to vocab_multiple")
    vocab_multiple: int = Field(
        64, ge=1, description="vocab_size = 0 pads the tokenizer's size to a multiple of this; "
        "the padded rows are never targets")
    max_seq_len: int = Field(0, ge=0, description="longest sequence (RoPE table); 0 = seq_len")
    tie_embeddings: bool = Field(False, description="share one matrix for input and output")
    logit_softcap: float = Field(0.0, ge=0, description="logits = cap*tanh(logits/cap); 0 = off")
    init_std: float = Field(0.02, gt=0, description="std of the block weight init")
    depth_init: bool = Field(True, description="scale output-projection init by block index")
    layerscale_init: float = Field(0.0, ge=0, description="LayerScale initial value; 0 = off")
    attention: Sub("attention") = component("attention", "causal", "token mixer of each block")
    ffn: Sub("ffn") = component("ffn", "swiglu", "feed-forward of each block")
    norm: Sub("norm") = component("norm", "rmsnorm", "pre-norms, state norm, final norm")
    injection: Literal["add", "adapter"] = Field(
        "add", description="input injection: lambda*s + e, or a Linear on cat[lambda*s, e] "
        "(initialised to the same sum)"
    )
    state_init: Literal["zeros", "embedding", "normal"] = Field(
        "zeros", description="s_0 when there is no carry: zeros, e, or N(0, init_std) noise"
    )
    state_norm: bool = Field(False, description="normalise the state after every loop")
    loop_scale: Literal["fixed", "learned", "scheduled"] = Field(
        "fixed", description="lambda: a constant, learned in (0, loop_scale_max), or linear "
        "from loop_scale_init to loop_scale_end over training"
    )
    loop_scale_init: float = Field(1.0, description="lambda (fixed), its start value otherwise")
    loop_scale_end: float = Field(1.0, description="scheduled lambda at the last step")
    loop_scale_max: float = Field(2.0, gt=0, description="upper bound of a learned lambda")
    random_loops: Literal["off", "uniform", "poisson_lognormal"] = Field(
        "off", description="draw H per training step (same on every rank): uniform in "
        "[min_loops, loops], or Poisson-lognormal with mean loops (clamped), as Geiping et al.; "
        "standard step only (segmented steps run all H)"
    )
    min_loops: int = Field(1, ge=1, description="smallest drawn loop count")
    backprop_loops: int = Field(
        0, ge=0, description="backpropagate through only the last k loops of a forward (0 = all)"
    )
    carry: bool = Field(False, description="carry each row's final state into the next step")
    carry_max_steps: int = Field(
        0, ge=0, description="reset a row's carry after this many steps (0 = never)"
    )
    carry_reset_token: int = Field(
        -1, ge=-1, description="reset a row's carry after a window containing this token id "
        "(its document ended; e.g. the EOS id) (-1 = off)"
    )
    seed: int = Field(0, ge=0, lt=2**63, description="seed of the random loop counts")

    @model_validator(mode="after")
    def _check(self) -> LoopedConfig:
        check_block_shapes(self)
        if self.min_loops > self.loops:
            raise ValueError(f"min_loops ({self.min_loops}) exceeds loops ({self.loops})")
        if self.loop_scale == "learned" and not 0 < self.loop_scale_init < self.loop_scale_max:
            raise ValueError(
                f"a learned loop scale needs 0 < loop_scale_init ({self.loop_scale_init}) < "
                f"loop_scale_max ({self.loop_scale_max})"
            )
        return self


@register("model", "looped")
class Looped(MoEModelMixin, ModelContract, RetiedOnEmpty):
    """Recurrent-depth decoder: prelude, a looped block stack with input injection, coda."""

    Config = LoopedConfig

    def __init__(self, cfg: LoopedConfig, *, vocab_size: int, seq_len: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.vocab_size, self.max_seq_len = resolve_sizes("looped", cfg, vocab_size, seq_len)
        self.tied = cfg.tie_embeddings
        self.dim, self.loops = cfg.dim, cfg.loops
        p, r = cfg.n_prelude, cfg.n_recurrent
        self.n_layers = p + r + cfg.n_coda
        self.prelude_ids = [str(i) for i in range(p)]
        self.recurrent_ids = [str(i) for i in range(p, p + r)]
        self.coda_ids = [str(i) for i in range(p + r, self.n_layers)]
        dim, n = cfg.dim, self.n_layers
        with torch.random.fork_rng(devices=[]):  # init_weights() draws from the caller's RNG
            self.tok_embeddings = nn.Embedding(self.vocab_size, dim)
            self.layers = build_blocks(cfg, n, self.max_seq_len)
            self.adapter = (nn.Linear(2 * dim, dim, bias=False)
                            if cfg.injection == "adapter" else None)
            self.state_norm = cfg.norm.build(dim=dim) if cfg.state_norm else None
            self.norm = cfg.norm.build(dim=dim)
            self.output = nn.Linear(dim, self.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.loop_scale_raw = (nn.Parameter(torch.zeros(1)) if cfg.loop_scale == "learned"
                               else None)
        self.progress = 0.0  # fraction of training done (scheduled lambda)
        self.step = 0  # optimizer step (random loop counts)
        self.carry = Carry(cfg) if cfg.carry else None
        self._window: LoopWindow | None = None
        self._slot = 0  # micro-batch index within a step (standard step, no window)
        self._last_scale: torch.Tensor | float | None = None  # lambda of the last forward
        # Diagnostics set this to see the state after every loop: observer(loop index, state).
        self.loop_observer: Callable[[int, torch.Tensor], None] | None = None
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights()

    # ------------------------------------------------------------------------ protocol
    def blocks(self) -> list[nn.Module]:
        return list(self.layers.values())

    @torch.no_grad()
    def init_weights(self) -> None:
        cfg, std = self.cfg, self.cfg.init_std
        nn.init.normal_(self.tok_embeddings.weight, std=std if cfg.tie_embeddings else 1.0)
        init_blocks(self.blocks(), std, cfg.depth_init)
        for norm in (self.state_norm, self.norm):
            if norm is not None:
                init_component(norm, std, std)
        if self.adapter is not None:  # [I | I]: starts as the additive injection
            w = self.adapter.weight
            eye = torch.eye(self.dim, device=w.device, dtype=w.dtype)
            full = torch.cat([eye, eye], 1)
            if is_dtensor(w):  # sharded meta init: each rank writes its own slice
                from torch.distributed.tensor import distribute_tensor

                full = distribute_tensor(full, w.device_mesh, w.placements, src_data_rank=None)
            w.copy_(full)
        if self.loop_scale_raw is not None:
            frac = cfg.loop_scale_init / cfg.loop_scale_max
            self.loop_scale_raw.fill_(math.log(frac / (1 - frac)))
        if not cfg.tie_embeddings:
            out_std = self.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, std=out_std, a=-3 * out_std, b=3 * out_std)

    def set_progress(self, step: int, total_steps: int) -> None:
        """Called before every global step: drives the lambda schedule and loop-count draws."""
        self.step = int(step)
        self.progress = min(max(step / max(total_steps - 1, 1), 0.0), 1.0)

    def loop_scale(self) -> torch.Tensor | float:
        cfg = self.cfg
        if self.loop_scale_raw is not None:
            return cfg.loop_scale_max * torch.sigmoid(self.loop_scale_raw)
        if cfg.loop_scale == "scheduled":
            return cfg.loop_scale_init + (cfg.loop_scale_end - cfg.loop_scale_init) * self.progress
        return cfg.loop_scale_init

    def value_jacobians(self) -> dict[nn.Parameter, Callable[[torch.Tensor], torch.Tensor]]:
        """Parameters that parameterise a value, with d value / d parameter (elementwise):
        the learned loop scale, lambda = lambda_max * sigmoid(raw). ``sign_sgd`` with
        ``value_space`` uses it to move lambda itself by lr (the reference's lambda step)."""
        if self.loop_scale_raw is None:
            return {}
        lam_max = self.cfg.loop_scale_max

        def dlambda(raw: torch.Tensor) -> torch.Tensor:
            s = torch.sigmoid(raw.float())
            return (lam_max * s * (1 - s)).to(raw.dtype)

        return {self.loop_scale_raw: dlambda}

    # ------------------------------------------------------------------------- forward
    @contextlib.contextmanager
    def loop_window(self, start: int, stop: int, *, slot: int = 0,
                    state: torch.Tensor | None = None) -> Iterator[LoopWindow]:
        """Within the block, a training forward runs loops [start, stop) from ``state`` (the
        state after ``start`` loops; None at 0: carry or init) and leaves the state after
        ``stop`` loops in ``window.state_out``; the loss is read at stop (coda + head)."""
        if not 0 <= start < stop <= self.loops or (state is None) != (start == 0):
            raise ValueError(f"bad loop window [{start}, {stop}) of {self.loops} loops "
                             f"(state given: {state is not None})")
        self._window = LoopWindow(start, stop, slot, state)
        try:
            yield self._window
        finally:
            self._window = None

    def forward(self, input_ids: torch.Tensor, *, loops: int | None = None,
                head: HeadFn | None = None,
                context: AttentionContext | None = None) -> torch.Tensor:
        """(B, T) -> logits (B, T, V); ``loops`` = H_eff for evaluation (early exit); with
        ``head``, ``head(hidden, weight, softcap)`` instead (the chunked loss, ``lm_head``);
        ``context``: every block's attention layout (``attention/context.py``)."""
        if loops is not None and not 1 <= loops <= self.loops:
            raise ValueError(f"loops must be in [1, {self.loops}], got {loops}")
        e = self.tok_embeddings(input_ids)  # (B, T, dim)
        for i in self.prelude_ids:
            e = self.layers[i](e, context=context)
        w, slot = self._window, None
        if w is not None:
            start, stop, slot = w.start, w.stop, w.slot
        else:
            start, stop = 0, loops or (self._draw_loops() if self.training else self.loops)
            if self.training:
                slot, self._slot = self._slot, self._slot + 1
        if w is not None and w.state_in is not None:
            s = w.state_in
        else:
            s = self._initial_state(e, input_ids, slot)
        s = self._run_loops(s, e, start, stop, context)
        if w is not None:
            w.state_out = s
        if self.carry is not None and self.training and slot is not None and (
                w is None or stop == self.loops):
            self.carry.stage(slot, s, input_ids)
        for i in self.coda_ids:
            s = self.layers[i](s, context=context)
        s = self.norm(s)
        if head is not None:
            return head(*head_operands(s, self.output), self.cfg.logit_softcap)
        return logits(s, self.output, self.cfg.logit_softcap)  # (B, T, V)

    def _draw_loops(self) -> int:
        """H for this training forward: the same on every rank (seeded by step and slot)."""
        cfg = self.cfg
        if cfg.random_loops == "off":
            return self.loops
        key = (cfg.seed * 1_000_003 + self.step) * 1009 + self._slot
        g = torch.Generator().manual_seed(key % (1 << 64))  # (manual_seed takes 64 bits)
        if cfg.random_loops == "uniform":
            h = int(torch.randint(cfg.min_loops, self.loops + 1, (1,), generator=g))
        else:  # Poisson with a lognormal rate around the mean (Geiping et al. 2025)
            sigma = 0.5
            mu = math.log(self.loops) - sigma**2 / 2
            rate = math.exp(mu + sigma * float(torch.randn(1, generator=g)))
            h = int(torch.poisson(torch.tensor([rate]), generator=g))
        return min(max(h, cfg.min_loops), self.loops)

    def _initial_state(self, e: torch.Tensor, ids: torch.Tensor, slot: int | None) -> torch.Tensor:
        init = self.cfg.state_init
        if init == "zeros":
            fresh = torch.zeros_like(e)
        elif init == "embedding":
            fresh = e
        else:
            fresh = torch.randn_like(e) * self.cfg.init_std
        if self.carry is not None and self.training and slot is not None:
            return self.carry.initial(slot, fresh)
        return fresh

    def _run_loops(self, s: torch.Tensor, e: torch.Tensor, start: int, stop: int,
                   context: AttentionContext | None = None) -> torch.Tensor:
        k = self.cfg.backprop_loops
        first_grad = stop - k if (k and self.training) else start
        lam = self.loop_scale()
        # For metrics(): under FSDP the parameter is gathered only inside forward.
        self._last_scale = float(lam) if not isinstance(lam, torch.Tensor) else lam.detach()
        for i in range(start, stop):
            with torch.no_grad() if i < first_grad else contextlib.nullcontext():
                u = lam * s
                u = u + e if self.adapter is None else self.adapter(torch.cat([u, e], -1))
                for j in self.recurrent_ids:
                    u = self.layers[j](u, context=context)
                s = u if self.state_norm is None else self.state_norm(u)
            if self.loop_observer is not None:
                self.loop_observer(i, s)
        return s

    # ------------------------------------------------------------------- step protocol
    def on_optimizer_step(self, skipped: bool) -> None:
        if self.carry is not None:
            self.carry.commit(skipped)
        self._slot = 0

    def carry_state(self) -> dict[str, torch.Tensor] | None:
        return None if self.carry is None else self.carry.state_dict()

    def load_carry_state(self, d: dict[str, torch.Tensor] | None) -> None:
        if self.carry is None:
            if d:
                raise ValueError("this looped model has carry = false but the checkpoint holds "
                                 "a carry; set model.carry = true to resume it")
            return
        self.carry.load_state_dict(d or {})

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        if self._last_scale is not None:
            out["loop/scale"] = float(self._last_scale)
        if self.carry is not None:
            out.update(self.carry.metrics())
        return out

    # ------------------------------------------------------------------------- counting
    def _count(self, modules, active: bool) -> int:
        total = 0
        for m in modules:
            total += sum(p.numel() for p in m.parameters())
            if active:
                total -= idle_expert_params(m)
        return total

    def num_params(self, exclude_embeddings: bool = False, active_only: bool = False) -> int:
        """Distinct parameters (a tied matrix once); active_only: routed experts count k of E."""
        n = self._count([self], active_only)
        return n - self.tok_embeddings.weight.numel() if exclude_embeddings else n

    def param_summary(self) -> dict[str, int]:
        rec = [self.layers[i] for i in self.recurrent_ids]
        return {
            "total": self.num_params(),
            "active per token (MoE top-k)": self.num_params(active_only=True),
            "prelude": self._count([self.layers[i] for i in self.prelude_ids], False),
            "recurrent core (shared by all loops)": self._count(rec, False),
            "coda": self._count([self.layers[i] for i in self.coda_ids], False),
            "embedding": self.tok_embeddings.weight.numel(),
            "layers applied per token (H loops)": len(self.prelude_ids) + len(self.coda_ids)
            + self.loops * len(rec),
        }

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token of one full forward/backward with H loops and active
        parameters: forward 2 per multiply-add everywhere, backward 4 only through the loops
        that keep a graph (``backprop_loops``); attention over the full T x T square, as in the
        transformer. Segmented BPTT adds a coda + head per extra segment (not counted)."""
        h = self.loops
        k = min(self.cfg.backprop_loops or h, h)
        rec = [self.layers[i] for i in self.recurrent_ids]
        once = [self.layers[i] for i in self.prelude_ids + self.coda_ids]
        n_once = self._count(once, True) + self.output.weight.numel()
        n_rec = self._count(rec, True) + (self.adapter.weight.numel() if self.adapter else 0)
        attn = lambda blocks: sum(4 * b.attention.n_heads * b.attention.head_dim  # noqa: E731
                                  for b in blocks) * seq_len  # forward QK^T + AV per token
        return float(6 * n_once + (2 * h + 4 * k) * n_rec
                     + 3 * attn(once) + (h + 2 * k) * attn(rec))

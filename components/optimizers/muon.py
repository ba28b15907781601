"""Muon: momentum orthogonalised by Newton–Schulz, for 2-D weight matrices (Keller Jordan 2024).

The update rule is torch.optim.Muon's (momentum EMA with Nesterov, quintic NS in bf16, decoupled
weight decay, ``original`` or ``match_rms_adamw`` LR scaling; kiln adds ``spectral`` for µP),
bit for bit in one process, and the state is its ``momentum_buffer``, so checkpoints load into
either. torch's class is not used
directly because under FSDP2 it is wrong or fails (measured, torch 2.13, gloo): on DTensor
parameters its steps drifted from the single-process result (0.014 max abs after 3 steps on
matrices whose updates are ~0.05) and a matrix with fewer rows than ranks raised in ``add_``;
and it makes every rank gather and orthogonalise every matrix. Here same-shape matrices are
orthogonalised in one batched call, under FSDP2 each rank orthogonalises only the matrices it
owns (see ``orthogonalize``; bitwise equal to one process), 3-D MoE expert stacks are
orthogonalised per expert, and parameters Muon cannot train are reported by name.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field

from kiln.components.distributed import is_dtensor, local_tensor
from kiln.components.errors import RecipeError
from kiln.components.optimizers.common import OptimizerConfig, ParamRule
from kiln.components.optimizers.orthogonalize import (
    NS_COEFFICIENTS,
    is_row_sharded,
    lr_scale,
    newton_schulz,
    orthogonalize_sharded,
    resolve_ns_dtype,
)
from kiln.components.registry import register


class MuonConfig(OptimizerConfig):
    lr: float = Field(0.02, ge=0, description="peak learning rate (the schedule scales it)")
    params: ParamRule = Field(
        default_factory=lambda: ParamRule(ndim=[2]),
        description="which parameters this optimizer trains (Muon: 2-D matrices only)",
    )
    momentum: float = Field(0.95, ge=0, lt=1, description="momentum EMA coefficient")
    nesterov: bool = Field(True, description="orthogonalise grad.lerp(momentum, mu) (Nesterov)")
    ns_steps: int = Field(5, ge=1, le=50, description="Newton–Schulz iterations")
    ns_coefficients: list[float] = Field(
        default_factory=lambda: list(NS_COEFFICIENTS), min_length=3, max_length=3,
        description="quintic Newton–Schulz coefficients (a, b, c)",
    )
    eps: float = Field(1e-7, gt=0, description="floor of the Frobenius norm NS divides by")
    ns_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto",
        description="Newton–Schulz precision: auto = bfloat16 on GPUs and other accelerators "
        "(torch.optim.Muon's), float32 on CPU (emulated bf16 matmuls are slower there)",
    )
    lr_scaling: Literal["original", "match_rms_adamw", "spectral"] = Field(
        "original",
        description="per-matrix LR factor: original = max(1, rows/cols)**0.5 (Keller); "
        "match_rms_adamw = 0.2*sqrt(max(rows, cols)) (Moonlight: AdamW-like LR and decay); "
        "spectral = sqrt(rows/cols) (fan_out/fan_in: width-independent, what µP needs)",
    )
    mup_rule: ClassVar[str] = "own"

    def check_mup(self, table: str) -> None:
        if self.lr_scaling != "spectral":
            raise RecipeError(
                f"optimizer {table!r} (muon) with model.parametrization = \"mup\": "
                f"lr_scaling = \"{self.lr_scaling}\" changes the update's size with width; set "
                "lr_scaling = \"spectral\" (sqrt(fan_out / fan_in), Yang, Simon & Bernstein "
                "2023), which keeps Muon's learning rate width-independent")
    expert_stacks: bool = Field(
        False, description="also accept 3-D (experts, rows, cols) stacks, orthogonalised per expert"
    )

    def check_params(self, table: str, named: list[tuple[str, torch.Tensor]]) -> None:
        """Called by routing: name every routed parameter Muon cannot train."""
        _check(named, self.expert_stacks, table)


def _check(named: list[tuple[str, torch.Tensor]], expert_stacks: bool, table: str = "") -> None:
    allowed = (2, 3) if expert_stacks else (2,)
    bad = [f"{n} {tuple(p.shape)}" for n, p in named if p.ndim not in allowed]
    if bad:
        where = f"[optimizers.{table}]" if table else "muon"
        hint = "" if expert_stacks else ", or set expert_stacks = true for 3-D expert stacks"
        raise RecipeError(
            f"{where} (muon) trains {' or '.join(f'{d}-D' for d in allowed)} parameters only, "
            f"but these were routed to it: {', '.join(bad[:20])}{' ...' if len(bad) > 20 else ''}"
            f". Route them to another optimizer (e.g. `ndim = [2]` in its `params` rule){hint}"
        )


def check_shapes(groups: list[dict], expert_stacks: bool) -> None:
    """The same check on param groups (names from ``param_names`` when the groups carry them)."""
    named = []
    for g in groups:
        names = g.get("param_names") or [f"{g.get('name', 'group')}[{i}]"
                                         for i in range(len(g["params"]))]
        named += list(zip(names, g["params"], strict=True))
    _check(named, expert_stacks)


class Muon(torch.optim.Optimizer):
    """Muon over plain tensors and FSDP2 DTensors; state ``momentum_buffer`` like torch's."""

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.0,
                 momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                 eps: float = 1e-7, lr_scaling: str = "original", expert_stacks: bool = False,
                 ns_dtype: str = "auto"):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_steps=ns_steps, ns_coefficients=tuple(ns_coefficients), eps=eps,
                        lr_scaling=lr_scaling)
        super().__init__(params, defaults)
        self.expert_stacks = expert_stacks
        # an attribute, not a group default: groups loaded from older checkpoints lack new keys
        self.ns_dtype = ns_dtype
        check_shapes(self.param_groups, expert_stacks)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        owner_turn = 0  # rotates matrix ownership across shape buckets and groups
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            bufs = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                bufs.append(_local(state["momentum_buffer"]))
            grads = [_local(p.grad) for p in params]
            mu = group["momentum"]
            torch._foreach_lerp_(bufs, grads, 1 - mu)  # elementwise: fine on local shards
            updates = torch._foreach_lerp(grads, bufs, mu) if group["nesterov"] else bufs
            ns = dict(coefficients=group["ns_coefficients"], steps=group["ns_steps"],
                      eps=group["eps"], dtype=resolve_ns_dtype(self.ns_dtype, grads[0].device))
            ortho, owner_turn = _orthogonalize(params, updates, ns, owner_turn)
            lr, wd = group["lr"], group["weight_decay"]
            for p, o in zip(params, ortho, strict=True):
                local = _local(p)
                if wd:
                    local.mul_(1 - lr * wd)
                local.add_(o, alpha=-lr * lr_scale(group["lr_scaling"], *p.shape[-2:]))
        return loss


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


def _orthogonalize(params, updates, ns: dict, owner_turn: int):
    """NS of every update (local tensors), batched by shape; returns local results in order."""
    out: list[torch.Tensor | None] = [None] * len(params)
    buckets: dict[tuple, list[int]] = {}
    for i, p in enumerate(params):
        if p.ndim == 2 and is_row_sharded(p):
            key = ("sharded", tuple(p.shape), id(p.device_mesh.get_group()))
        elif not is_dtensor(p) or (
            p.ndim == 3 and is_row_sharded(p)  # whole experts per rank: NS is local
        ):
            key = ("local", tuple(updates[i].shape[-2:]), updates[i].dtype)
        else:
            key = ("gather", i)
        buckets.setdefault(key, []).append(i)
    for key, ids in buckets.items():
        if key[0] == "sharded":
            p0 = params[ids[0]]
            res = orthogonalize_sharded(
                [updates[i] for i in ids], tuple(p0.shape), p0.device_mesh.get_group(),
                first_owner=owner_turn, **ns,
            )
            owner_turn += len(ids)
        elif key[0] == "local":
            stack = torch.cat([updates[i].reshape(-1, *key[1]) for i in ids])  # (N, m, n)
            flat = newton_schulz(stack, **ns)
            sizes = [updates[i].numel() // (key[1][0] * key[1][1]) for i in ids]
            res = [f.view(updates[i].shape) for f, i in zip(flat.split(sizes), ids, strict=True)]
        else:  # other layouts (TP, HSDP): gather the full matrix, then keep this rank's part
            from torch.distributed.tensor import DTensor, distribute_tensor

            p = params[ids[0]]
            full = DTensor.from_local(updates[ids[0]], p.device_mesh, p.placements,
                                      shape=p.shape, stride=p.stride()).full_tensor()
            o = newton_schulz(full, **ns)
            res = [distribute_tensor(o, p.device_mesh, p.placements, src_data_rank=None)
                   .to_local()]
        for i, r in zip(ids, res, strict=True):
            out[i] = r
    return out, owner_turn


@register("optimizer", "muon", config=MuonConfig)
def build_muon(cfg: MuonConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """Muon (Newton–Schulz orthogonalised momentum) for 2-D weight matrices."""
    coeffs = (cfg.ns_coefficients[0], cfg.ns_coefficients[1], cfg.ns_coefficients[2])
    return Muon(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                nesterov=cfg.nesterov, ns_steps=cfg.ns_steps, ns_coefficients=coeffs,
                eps=cfg.eps, lr_scaling=cfg.lr_scaling, expert_stacks=cfg.expert_stacks,
                ns_dtype=cfg.ns_dtype)

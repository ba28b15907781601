"""``parallelize``: the one entry point, applying each step in a fixed, documented order.

1. float8 conversion (torchao) — swaps Linear modules, so it comes before any wrapper;
2. activation checkpointing — wraps blocks;
3. per-block ``torch.compile`` — compiles the (wrapped) blocks, so recomputation is compiled too;
4. FSDP2 ``fully_shard`` per block, then the root — outermost, so its hooks (all-gather,
   reduce-scatter) run around the compiled, checkpointed blocks.

Works on a model built on ``meta`` (then ``meta_init.materialize``) or on a real device.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn

from kiln.parallelisms.activation_checkpoint import apply_activation_checkpoint
from kiln.parallelisms.compile import apply_compile
from kiln.parallelisms.config import ParallelismConfig
from kiln.parallelisms.float8 import apply_float8, float8_post_optimizer_step
from kiln.parallelisms.grads import all_reduce_grads, clip_grad_norm, grad_sync_context

if TYPE_CHECKING:  # FSDP2 and the mesh are imported when used: single-process runs skip them
    from torch.distributed.device_mesh import DeviceMesh


class WorldLike(Protocol):
    """What parallelize needs of ``kiln.components.distributed.World``."""

    world_size: int
    device: torch.device


@dataclass
class ParallelPlan:
    """What was applied, and the per-step calls the trainer makes for it."""

    model: nn.Module
    world_size: int
    mesh: DeviceMesh | None = None
    fsdp: bool = False
    replicated: bool = False  # world > 1 without FSDP: gradients all-reduced by sync_grads
    float8: str = "off"
    float8_modules: list[str] = field(default_factory=list)
    float8_scale_precompute: bool = False
    parts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bucket_mb: int = 25

    @property
    def summary(self) -> str:
        """One line for the start-up log and ``kiln bench``."""
        return ", ".join(self.parts) if self.parts else "single process"

    def describe(self) -> str:
        """The summary, notes, and the float8 layers (start-up log)."""
        lines = [self.summary, *self.notes]
        if self.float8_modules:
            lines.append(f"float8 {self.float8} layers: {_compress(self.float8_modules)}")
        return "\n".join(lines)

    def grad_sync(self, is_last_microbatch: bool) -> AbstractContextManager:
        """Wrap each micro-batch's backward: FSDP2 reduces gradients on the last one only."""
        return grad_sync_context(self.model, is_last_microbatch)

    def sync_grads(self) -> None:
        """After the last backward: average gradients of a replicated (non-FSDP) model."""
        if self.replicated:
            all_reduce_grads(self.model, self.world_size, self.bucket_mb)

    def clip_grads(self, max_norm: float) -> torch.Tensor:
        """Clip to the global norm over all shards (0 = measure only); returns that norm."""
        return clip_grad_norm(self.model.parameters(), max_norm)

    def after_optimizer_step(self) -> None:
        """tensorwise float8 + FSDP2 float8 all-gather: precompute next step's weight scales."""
        if self.float8_scale_precompute:
            float8_post_optimizer_step(self.model)


def _compress(names: list[str]) -> str:
    """``layers.0.attention.wq, layers.1.attention.wq`` -> ``layers.*.attention.wq x2``."""
    counts: dict[str, int] = {}
    for name in names:
        key = ".".join("*" if part.isdigit() else part for part in name.split("."))
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in counts.items())


def _use_fsdp(cfg: ParallelismConfig, world_size: int) -> tuple[bool, str]:
    if cfg.fsdp == "off":
        return False, ""
    if world_size > 1:
        return True, ""
    if cfg.fsdp == "on":
        if dist.is_available() and dist.is_initialized():
            return True, ""
        return False, "parallelism.fsdp = on ignored: single process without a process group"
    return False, ""


def parallelize(
    model: nn.Module, cfg: ParallelismConfig, world: WorldLike, mesh: DeviceMesh | None = None
) -> ParallelPlan:
    """Apply float8 -> activation checkpointing -> compile -> FSDP2 to ``model`` in place."""
    fsdp, note = _use_fsdp(cfg, world.world_size)
    plan = ParallelPlan(model=model, world_size=world.world_size, fsdp=fsdp,
                        bucket_mb=cfg.grad_bucket_mb, float8=cfg.float8)
    if note:
        plan.notes.append(note)
    if fsdp:
        from kiln.parallelisms.fsdp import fsdp_summary
        from kiln.parallelisms.mesh import build_mesh

        plan.mesh = mesh or build_mesh(cfg, world.world_size, world.device.type)
        plan.parts.append(fsdp_summary(cfg, plan.mesh))
    elif world.world_size > 1:
        plan.replicated = True
        plan.parts.append(f"data parallel over {world.world_size} ranks (gradient all-reduce)")

    converted, f8_note = apply_float8(model, cfg, world.device, fsdp)
    plan.float8_modules = converted
    if converted:
        plan.parts.append(f"float8 {cfg.float8} on {len(converted)} Linear layers")
        plan.float8_scale_precompute = (
            fsdp and cfg.float8 == "tensorwise" and cfg.float8_fsdp_all_gather
        )
    if f8_note:
        plan.notes.append(f8_note)

    checkpointed = apply_activation_checkpoint(model, cfg)
    compiled = apply_compile(model, cfg, world.device)
    plan.parts += [text for text in (compiled, checkpointed) if text]
    if fsdp:
        from kiln.parallelisms.fsdp import apply_fsdp
        from kiln.parallelisms.mesh import fsdp_mesh

        apply_fsdp(model, cfg, fsdp_mesh(plan.mesh))
    return plan

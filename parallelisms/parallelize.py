"""``parallelize``: the one entry point, applying each step in a fixed, documented order.

0. pipeline split (``parallelism.pp``) — prunes the model to this rank's stages, so every later
   step works on the part this rank holds (``kiln.parallelisms.pipeline.stages``);
1. float8 conversion (torchao) — swaps Linear modules, so it comes before anything that holds
   on to them (tensor-parallel hooks are registered on the module objects);
2. expert parallel (``parallelism.ep``) — MoE expert stacks become ``Shard(0)`` DTensors over
   the mesh's ``ep`` ranks (before tensor parallel, which leaves DTensors alone);
3. tensor parallel (``parallelism.tp``) — DTensor plans per block over the mesh's ``tp``
   dimension (torchao's float8 all-gather styles for tensorwise float8 layers);
4. activation checkpointing — wraps blocks;
5. per-block ``torch.compile`` — compiles the (wrapped) blocks, so recomputation is compiled too;
6. FSDP2 ``fully_shard`` per block, then the root, over the data-parallel dimensions (and the
   context-parallel one: its ranks train different tokens) — outermost, so its hooks
   (all-gather, reduce-scatter) run around the compiled, checkpointed blocks; with tp > 1 the
   parameters become 2-D (or 3-D with HSDP) DTensors.

Context parallel (``parallelism.cp``) changes no module: the plan carries its group
(``plan.cp``), the trainer gives each rank its chunks of every row and the attention gathers
keys and values (``context_parallel.py``). Under pipeline
   parallelism each stage module is a root of its own.

Works on a model built on ``meta`` (then ``meta_init.materialize``) or on a real device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn

from kiln.components.distributed import is_dtensor
from kiln.parallelisms.activation_checkpoint import apply_activation_checkpoint
from kiln.parallelisms.compile import apply_compile
from kiln.parallelisms.config import ParallelismConfig
from kiln.parallelisms.float8 import (
    apply_float8,
    float8_emulated,
    float8_pad,
    float8_post_optimizer_step,
)
from kiln.parallelisms.grads import all_reduce_grads, clip_grad_norm, grad_sync_context
from kiln.parallelisms.layout.check import model_problems, raise_problems
from kiln.parallelisms.layout.mesh import layout

if TYPE_CHECKING:  # FSDP2, DTensor plans and the mesh are imported when used: single-process
    # runs skip them (about 1 s to the first step on a small CPU)
    from torch.distributed.device_mesh import DeviceMesh

    from kiln.parallelisms.context_parallel import ContextParallel
    from kiln.parallelisms.expert_parallel import ExpertParallel
    from kiln.parallelisms.pipeline.stages import Pipeline
    from kiln.parallelisms.tensor_parallel import TensorParallel


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
    float8_emulated: bool = False  # the converted layers' matmuls run in float32 (float8_emulate)
    float8_scale_precompute: bool = False
    parts: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    bucket_mb: int = 25
    tp: TensorParallel | None = None
    ep: ExpertParallel | None = None
    dp_size: int = 0  # ranks training different tokens (dp x cp); 0 = the world size
    dp_group: object = None  # their process group, for the replicated (non-FSDP) all-reduce
    cp: ContextParallel | None = None  # context parallel: the trainer shards each row by it
    pipeline: Pipeline | None = None  # pp > 1: this rank's stages and their schedule

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

    @property
    def loss_parallel(self) -> bool:
        return self.tp is not None and self.tp.loss_parallel

    @contextlib.contextmanager
    def grad_sync(self, is_last_microbatch: bool) -> Iterator[None]:
        """Wrap each micro-batch's forward and backward: FSDP2 reduces gradients on the last one
        only; with loss parallel, the sharded cross-entropy runs (forward and backward) here."""
        with grad_sync_context(self.model, is_last_microbatch), self.loss_context():
            yield

    def loss_context(self) -> AbstractContextManager:
        """Around a loss on the model's logits (sharded over the vocabulary with loss parallel)."""
        if self.tp is None:
            return contextlib.nullcontext()
        from kiln.parallelisms.tensor_parallel import loss_parallel_context

        return loss_parallel_context(self.loss_parallel)

    def loss(self, fn: Callable, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """``fn(logits, labels)`` as a plain scalar tensor, whether the logits are a plain tensor
        or vocabulary-sharded (loss parallel: the loss is a replicated DTensor)."""
        with self.loss_context():
            loss = fn(logits, labels)
        return loss.to_local() if is_dtensor(loss) else loss

    def sync_grads(self) -> None:
        """After the last backward: sum the partial gradients of parameters tensor parallel left
        whole; average the expert-parallel gradients and those of a replicated (non-FSDP)
        model."""
        if self.pipeline is not None:
            self.pipeline.sync_shared_grads()
        if self.tp is not None:
            self.tp.sync_grads(self.model)
        if self.ep is not None:
            self.ep.sync_grads()
        if self.replicated:
            skip = set(self.ep.params) if self.ep is not None else set()
            all_reduce_grads(self.model, self.dp_size or self.world_size, self.bucket_mb,
                             group=self.dp_group, skip=skip)

    def clip_grads(self, max_norm: float) -> torch.Tensor:
        """Clip to the global norm over all shards and pipeline stages (0 = measure only);
        returns that norm."""
        if self.pipeline is not None:
            return clip_grad_norm(self.model.parameters(), max_norm,
                                  stage_ranks=self.pipeline.stage_ranks,
                                  extra=self.pipeline.copies())
        return clip_grad_norm(self.model.parameters(), max_norm)

    @property
    def stage_group(self):
        """The ranks holding the same parameters as this one (all, without a pipeline)."""
        return self.pipeline.stage_group if self.pipeline is not None else None

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


def _use_fsdp(cfg: ParallelismConfig, dp_size: int) -> tuple[bool, str]:
    if cfg.fsdp == "off":
        return False, ""
    if dp_size > 1:
        return True, ""
    if cfg.fsdp == "on":
        if dist.is_available() and dist.is_initialized():
            return True, ""
        return False, "parallelism.fsdp = on ignored: single process without a process group"
    return False, ""


def parallelize(
    model: nn.Module, cfg: ParallelismConfig, world: WorldLike, mesh: DeviceMesh | None = None,
    ep_mesh: DeviceMesh | None = None, *, training=None, grad_accum: int = 1, checkpoint=None,
    attention=None,
) -> ParallelPlan:
    """Apply pipeline split -> float8 -> expert parallel -> tensor parallel -> activation
    checkpointing -> compile -> FSDP2 to ``model`` in place (after checking that the layout
    divides the model). ``mesh`` and ``ep_mesh``: meshes of this layout built earlier (the
    health check), reused. ``training`` (the ``[training]`` table) and ``grad_accum``
    (micro-batches per step and data-parallel rank) are needed for pipeline parallelism,
    ``checkpoint`` (the ``[checkpoint]`` table) and ``attention`` (``[model.attention]``) to
    refuse what it cannot do yet."""
    shape = layout(cfg, world.world_size)
    problems = model_problems(model, shape.tp, shape.ep, shape.cp)
    if cfg.pp > 1:
        from kiln.parallelisms.pipeline.checks import pipeline_problems

        problems += pipeline_problems(cfg, training, model, grad_accum, checkpoint, attention)
    raise_problems(problems, shape.describe())
    grad_ranks = shape.grad_ranks  # ranks training different tokens: data and context parallel
    fsdp, note = _use_fsdp(cfg, grad_ranks)
    plan = ParallelPlan(model=model, world_size=world.world_size, fsdp=fsdp,
                        bucket_mb=cfg.grad_bucket_mb, float8=cfg.float8, dp_size=grad_ranks)
    if note:
        plan.notes.append(note)
    if (fsdp or shape.tp > 1 or shape.cp > 1 or shape.pp > 1
            or 1 < grad_ranks < world.world_size):
        from kiln.parallelisms.layout.mesh import build_mesh

        plan.mesh = mesh or build_mesh(cfg, world.world_size, world.device.type)
    if shape.cp > 1:
        from kiln.parallelisms.context_parallel import context_parallel

        plan.cp = context_parallel(plan.mesh)
        plan.parts.append(plan.cp.describe())
    if shape.pp > 1:
        from kiln.parallelisms.pipeline.stages import split_model

        plan.pipeline = split_model(
            model, cfg, plan.mesh, rank=getattr(world, "rank", dist.get_rank()),
            device=world.device, seq_len=training.seq_len, grad_accum=grad_accum, fsdp=fsdp)
        plan.parts.append(plan.pipeline.describe())
    if fsdp:
        from kiln.parallelisms.fsdp import fsdp_summary

        plan.parts.append(fsdp_summary(cfg, plan.mesh))
    elif grad_ranks > 1:
        from kiln.parallelisms.layout.mesh import dp_mesh

        plan.replicated = True
        plan.dp_group = dp_mesh(plan.mesh).get_group() if plan.mesh is not None else None
        what = "data and context parallel" if shape.cp > 1 else "data parallel"
        plan.parts.append(f"{what} over {grad_ranks} ranks (gradient all-reduce)")

    pad = cfg.float8 != "off" and float8_pad(cfg, training, shape.cp)
    converted, f8_note = apply_float8(model, cfg, world.device, fsdp, pad)
    plan.float8_modules = converted
    if converted:
        plan.float8_emulated = float8_emulated(cfg, world.device)
        how = ", ".join(w for w, on in (("emulated", plan.float8_emulated),
                                        ("inner dimension padded", pad)) if on)
        plan.parts.append(f"float8 {cfg.float8}{f' ({how})' if how else ''} on "
                          f"{len(converted)} Linear layers")
        plan.float8_scale_precompute = (
            fsdp and cfg.float8 == "tensorwise" and cfg.float8_fsdp_all_gather
        )
    if f8_note:
        plan.notes.append(f8_note)

    if shape.ep > 1:
        from kiln.parallelisms.expert_parallel import apply_expert_parallel
        from kiln.parallelisms.layout.mesh import expert_mesh

        plan.ep = apply_expert_parallel(model, ep_mesh or expert_mesh(shape, world.device.type),
                                        shape.dp)
        plan.parts.insert(0, plan.ep.describe())
    if shape.tp > 1:
        from kiln.parallelisms.tensor_parallel import apply_tensor_parallel

        plan.tp = apply_tensor_parallel(model, plan.mesh["tp"], loss_parallel=cfg.loss_parallel,
                                        float8=cfg.float8 if converted else "off")
        plan.parts.insert(0, plan.tp.describe())

    checkpointed = apply_activation_checkpoint(model, cfg)
    compiled = apply_compile(model, cfg, world.device)
    plan.parts += [text for text in (compiled, checkpointed) if text]
    if plan.pipeline is not None:
        plan.pipeline.build_parts()  # after the blocks were wrapped: the stages run them
        plan.pipeline.loss_context = plan.loss_context
    if fsdp:
        from kiln.parallelisms.fsdp import apply_fsdp
        from kiln.parallelisms.layout.mesh import fsdp_mesh

        ignored = set(plan.ep.params) if plan.ep is not None else None
        roots = plan.pipeline.parts if plan.pipeline is not None else None
        apply_fsdp(model, cfg, fsdp_mesh(plan.mesh), ignored=ignored, roots=roots)
    return plan

"""Gradient synchronisation and clipping across data-parallel ranks.

With FSDP2 the gradients are synchronised by the backward itself (reduce-scatter, plus an
all-reduce across HSDP replicas); under gradient accumulation ``grad_sync_context`` turns that
off for every micro-batch but the last. Without FSDP (``fsdp = "off"``, world > 1) the model is
replicated and ``all_reduce_grads`` averages the accumulated gradients once per step.

Division: both paths average over data-parallel ranks; with each rank's loss a mean over its
own tokens, the result is the gradient of the global mean loss (see ``kiln.parallelisms.fsdp``).
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections import defaultdict
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from kiln.components import distributed
from kiln.components.distributed import is_dtensor


@contextlib.contextmanager
def grad_sync_context(model: nn.Module, is_last_microbatch: bool) -> Iterator[None]:
    """Around one micro-batch's backward: FSDP2 syncs gradients only on the last one."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no FSDPModule exists
    if fsdp is not None and isinstance(model, fsdp.FSDPModule):
        model.set_requires_gradient_sync(is_last_microbatch)
    yield


@torch.no_grad()
def all_reduce_grads(
    model: nn.Module, world_size: int, bucket_mb: int = 25, group=None,
    skip: set[nn.Parameter] | frozenset = frozenset(),
) -> None:
    """Average the gradients of a replicated model over the ``world_size`` ranks of ``group``
    (default: all), in flat buckets. Tensor-parallel (DTensor) gradients are averaged shard by
    shard: the ranks of a data-parallel group hold the same shard.

    Hand-rolled instead of wrapping in DistributedDataParallel so the model keeps its names and
    protocol (blocks(), init_weights()); the price is no overlap of communication with backward.
    A parameter without a gradient contributes zeros, so every rank sends the same buckets.
    """
    if world_size <= 1 or not distributed.is_initialized():
        return
    skipped = {id(p) for p in skip}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in skipped]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad.to_local() if is_dtensor(p.grad) else p.grad
        by_kind[(g.device, g.dtype)].append(g)
    limit = bucket_mb * 2**20
    for grads in by_kind.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= limit:
                _reduce_bucket(bucket, world_size, group)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, world_size, group)


def _reduce_bucket(grads: list[torch.Tensor], world_size: int, group) -> None:
    flat = _flatten_dense_tensors(grads)
    distributed.all_reduce_(flat, group=group)  # SUM: gloo has no AVG
    flat.div_(world_size)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)


def _copies(g: torch.Tensor, world_size: int) -> int:
    """How many ranks hold this very gradient tensor: every rank for a plain one (replicated
    and already synchronised), else the ranks outside its mesh times its replicated dims."""
    if not is_dtensor(g):
        return world_size
    mesh = g.device_mesh
    copies = world_size // mesh.size()
    for dim, placement in enumerate(g.placements):
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


def _shares(t: torch.Tensor, world: int) -> tuple[int, torch.Tensor]:
    """(how many ranks hold this rank's part of ``t``, that part): partial sums are summed
    first, so every element of the full tensor is counted once over all ranks."""
    if is_dtensor(t) and any(pl.is_partial() for pl in t.placements):
        from torch.distributed.tensor import Replicate  # imported already: t is a DTensor

        t = t.redistribute(placements=[Replicate() if pl.is_partial() else pl
                                       for pl in t.placements])  # sum the partial values
    return _copies(t, world), (t.to_local() if is_dtensor(t) else t)


@torch.no_grad()
def full_sum_squares(groups: list[list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    """(G,) fp32: per group, the sum of squares of its tensors' full values (DTensors of any
    layout: FSDP2, HSDP, tensor parallel; plain tensors, whole on every rank), the same on every
    rank, with one all-reduce (none when no tensor is a DTensor: every rank then has it all).
    For per-layer diagnostics: the figures of the full tensors, not of one rank's shard."""
    spread = any(is_dtensor(t) for group in groups for t in group)
    world = dist.get_world_size() if spread else 1
    out = torch.zeros(len(groups), dtype=torch.float32, device=device)
    for i, group in enumerate(groups):
        by_copies: dict[int, list[torch.Tensor]] = defaultdict(list)
        for t in group:
            copies, local = _shares(t, world)
            by_copies[copies].append(local.detach())
        for copies, members in by_copies.items():
            norms = torch.stack(torch._foreach_norm(members, 2, dtype=torch.float32)).to(device)
            out[i] += norms.pow(2).sum() / copies
    if world > 1:
        distributed.all_reduce_(out)
    return out


@torch.no_grad()
def grad_norm(params: Iterable[nn.Parameter], norm_type: float = 2.0, *,
              stage_ranks: int | None = None, extra: dict[int, int] | None = None
              ) -> torch.Tensor:
    """The global gradient norm as a plain fp32 tensor, identical on every rank.

    Each rank sums ``|g|^p`` over its local tensors (DTensor shards included), each divided by
    the number of ranks holding that same tensor, so one all-reduce over all ranks counts every
    element once, whatever the mix of meshes (FSDP2, HSDP, tensor parallel, whole parameters).
    Under pipeline parallelism (``stage_ranks``: the ranks of one pipeline stage) a tensor is
    held only within its stage, and ``extra`` (parameter id -> stages) counts a matrix two
    stages share (tied embeddings) once; the all-reduce then runs even for plain tensors.
    """
    params = [p for p in params if p.grad is not None]
    # Only a model with DTensor gradients is spread over ranks; a plain one is local (e.g. a
    # single-process reference computed inside a process group) and needs no collective.
    spread = stage_ranks is not None or any(is_dtensor(p.grad) for p in params)
    world = dist.get_world_size() if spread else 1
    within = stage_ranks or world
    extra = extra or {}
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        copies, local = _shares(p.grad, within)
        groups[(copies * extra.get(id(p), 1), local.device)].append(local)
    if not groups and world == 1:
        return torch.zeros(())
    device = next(iter(groups))[1] if groups else torch.device("cpu")
    inf = math.isinf(norm_type)
    parts = [torch.zeros((), device=device)]  # a rank without gradients still joins the sum
    for (copies, _), members in groups.items():
        norm = torch.nn.utils.get_total_norm(members, norm_type, foreach=True).float().to(device)
        parts.append(norm if inf else norm**norm_type / copies)
    total = torch.stack(parts).max() if inf else torch.stack(parts).sum()
    if world > 1:
        distributed.all_reduce_(total, op="max" if inf else "sum")
    return total if inf else total ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0, *,
    stage_ranks: int | None = None, extra: dict[int, int] | None = None,
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (0 or inf: measure only);
    return the norm before clipping (a plain tensor, the same on every rank). ``stage_ranks``
    and ``extra``: pipeline parallelism (see ``grad_norm``)."""
    params = [p for p in params if p.grad is not None]
    if stage_ranks is None and not extra and not any(is_dtensor(p.grad) for p in params):
        # One process's whole gradients: torch's own two calls, without the per-tensor
        # bookkeeping of grad_norm (host overhead on small models).
        grads = [p.grad for p in params]
        total = torch.nn.utils.get_total_norm(grads, norm_type, foreach=True).float() \
            if grads else torch.zeros(())
        if max_norm and not math.isinf(max_norm) and grads:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total
    total = grad_norm(params, norm_type, stage_ranks=stage_ranks, extra=extra)
    if not max_norm or math.isinf(max_norm) or not params:
        return total
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # no host sync: multiply by <= 1
    locals_ = defaultdict(list)
    for p in params:
        g = p.grad.to_local() if is_dtensor(p.grad) else p.grad
        locals_[(g.device, g.dtype)].append(g)
    for (dev, _), grads in locals_.items():
        torch._foreach_mul_(grads, coef.to(dev))
    return total

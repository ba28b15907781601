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
def all_reduce_grads(model: nn.Module, world_size: int, bucket_mb: int = 25) -> None:
    """Average the gradients of a replicated model over all ranks, in flat buckets.

    Hand-rolled instead of wrapping in DistributedDataParallel so the model keeps its names and
    protocol (blocks(), init_weights()); the price is no overlap of communication with backward.
    A parameter without a gradient contributes zeros, so every rank sends the same buckets.
    """
    if world_size <= 1 or not distributed.is_initialized():
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        by_kind[(p.grad.device, p.grad.dtype)].append(p.grad)
    limit = bucket_mb * 2**20
    for grads in by_kind.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for g in grads:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= limit:
                _reduce_bucket(bucket, world_size)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, world_size)


def _reduce_bucket(grads: list[torch.Tensor], world_size: int) -> None:
    flat = _flatten_dense_tensors(grads)
    distributed.all_reduce_(flat)  # SUM: gloo has no AVG
    flat.div_(world_size)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(synced)


def _norm_power(norms: torch.Tensor, norm_type: float) -> torch.Tensor:
    return norms.max() if math.isinf(norm_type) else (norms**norm_type).sum()


@torch.no_grad()
def grad_norm(params: Iterable[nn.Parameter], norm_type: float = 2.0) -> torch.Tensor:
    """The global gradient norm as a plain fp32 tensor, identical on every rank.

    DTensor gradients (FSDP2 shards) are reduced over their mesh; plain gradients are taken to be
    the same on every rank (replicated and already synchronised) and count once.
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    device = None
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        key = (g.device_mesh, g.placements) if is_dtensor(g) else "plain"
        groups[key].append(g)
        device = device or (g.device if not is_dtensor(g) else g.to_local().device)
    if device is None:
        return torch.zeros(())
    parts = []
    for key, grads in groups.items():
        norm = torch.nn.utils.get_total_norm(grads, norm_type, foreach=True)
        if key != "plain":
            norm = norm.full_tensor()  # sums (or maxes) the shards' contributions
        parts.append(norm.float().to(device))
    total = _norm_power(torch.stack(parts), norm_type)
    return total if math.isinf(norm_type) else total ** (1.0 / norm_type)


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (0 or inf: measure only);
    return the norm before clipping (a plain tensor, the same on every rank)."""
    params = [p for p in params if p.grad is not None]
    total = grad_norm(params, norm_type)
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

"""Meta-device initialisation: build on ``meta``, parallelize, then allocate and initialise.

``materialize`` allocates the (sharded) parameters with ``to_empty`` and runs the model's own
``init_weights()`` so every rank ends up with the same model a single process would build.
Two methods, chosen by ``parallelism.init_mode``:

- **replica** (bit-equal to single-process init, any world size): each DTensor parameter is
  swapped, for the duration of ``init_weights()``, for a full-size plain tensor; every rank runs
  ``init_weights()`` from the same seed and keeps its own slice (``distribute_tensor`` with
  ``src_data_rank=None`` slices locally, no communication). Cost: the full model exists on each
  rank's device for a moment, so it is for models that fit (``replica_init_max_params``).
- **sharded** (scales to any size; deterministic for a given mesh, not bit-equal): ``init_weights``
  runs directly on the DTensor shards. On CUDA, DTensor's offset-based Philox RNG gives each shard
  its own part of one random stream (replicas agree); on CPU, where DTensor has no RNG tracker,
  each shard index seeds the generator with ``seed`` and its index. Every init op must be
  element-wise (normal_, uniform_, trunc_normal_, constants); an op that needs the whole matrix
  (orthogonal_) would be wrong here.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.components.adapter_contract import adapter_layers
from kiln.components.distributed import is_dtensor
from kiln.components.errors import KilnError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def _dtensor_params(model: nn.Module) -> dict[int, tuple[DTensor, list[tuple[nn.Module, str]]]]:
    """Distinct DTensor parameters (tied ones once) and every (module, name) that holds them."""
    found: dict[int, tuple[DTensor, list[tuple[nn.Module, str]]]] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if is_dtensor(p):
                found.setdefault(id(p), (p, []))[1].append((module, name))
    return found


def _init_weights(model: nn.Module) -> None:
    init = getattr(model, "init_weights", None)
    if init is None:
        raise KilnError(
            f"{type(model).__name__} has no init_weights(); meta-device init needs it (model "
            "protocol, docs/design.md), or set parallelism.meta_init = false"
        )
    init()
    for base, _, adapter in adapter_layers(model).values():  # added after the model's init
        adapter.reset_adapter(base)


@torch.no_grad()
def _init_replica(model: nn.Module, params: dict, device: torch.device, seed: int) -> None:
    swapped = []
    for p, owners in params.values():
        full = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                            requires_grad=p.requires_grad)
        for module, name in owners:
            module._parameters[name] = full
        swapped.append((p, owners, full))
    from torch.distributed.tensor import distribute_tensor

    try:
        torch.manual_seed(seed)
        _init_weights(model)
        for p, _, full in swapped:
            local = distribute_tensor(full.detach(), p.device_mesh, p.placements,
                                      src_data_rank=None).to_local()
            p.to_local().copy_(local)
    finally:
        for p, owners, _ in swapped:
            for module, name in owners:
                module._parameters[name] = p


def _shard_index(p: DTensor) -> int:
    """Which shard of ``p`` this rank holds (replicas share an index)."""
    from torch.distributed.tensor import Shard

    index = 0
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Shard):
            index = index * p.device_mesh.size(dim) + p.device_mesh.get_local_rank(dim)
    return index


@torch.no_grad()
def _init_sharded(model: nn.Module, params: dict, device: torch.device, seed: int) -> None:
    if device.type == "cuda":
        torch.manual_seed(seed)  # DTensor's RNG tracker offsets each shard within the stream
        _init_weights(model)
        return
    first = next(iter(params.values()))[0]
    torch.manual_seed(seed * 1_000_003 + _shard_index(first))
    with warnings.catch_warnings():
        # DTensor warns that it has no RNG tracker on CPU: the per-shard seed above stands in.
        warnings.filterwarnings("ignore", message="DTensor random operators may not")
        _init_weights(model)


def choose_mode(params: dict, mode: str, replica_max_params: int) -> str:
    if mode != "auto":
        return mode
    total = sum(p.numel() for p, _ in params.values())
    return "replica" if total <= replica_max_params else "sharded"


@torch.no_grad()
def _init_from_whole(model: nn.Module, whole: nn.Module, device: torch.device,
                     seed: int) -> None:
    """Initialise the whole model, then copy this rank's tensors (by name; a DTensor keeps
    its local slice) into ``model``: a pipeline stage gets exactly one process's values."""
    from kiln.parallelisms.blocks import clean_name

    whole.to_empty(device=device)
    torch.manual_seed(seed)
    _init_weights(whole)
    source = {clean_name(n): t for n, t in (*whole.named_parameters(remove_duplicate=False),
                                              *whole.named_buffers(remove_duplicate=False))}
    for name, t in (*model.named_parameters(remove_duplicate=False),
                    *model.named_buffers(remove_duplicate=False)):
        full = source[clean_name(name)]
        if is_dtensor(t):
            from torch.distributed.tensor import distribute_tensor

            full = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
            t.to_local().copy_(full.to_local())
        else:
            t.copy_(full)


def materialize(
    model: nn.Module, device: torch.device | str, seed: int, *, mode: str = "auto",
    replica_max_params: int = 2_000_000_000, pipeline=None,
) -> str:
    """Allocate a meta-built (and possibly sharded) model on ``device`` and initialise it from
    ``seed``; return a short description of the method for the start-up log. ``pipeline``
    (``kiln.parallelisms.pipeline.stages.Pipeline``): ``model`` is this rank's stages of a model
    whose
    whole meta copy the pipeline keeps (``skeleton``, dropped here)."""
    device = torch.device(device)
    model.to_empty(device=device)
    if pipeline is not None:
        whole, pipeline.skeleton = pipeline.skeleton, None
        total = sum(p.numel() for p in whole.parameters()) if whole is not None else 0
        if whole is not None and (mode == "replica" or (
                mode == "auto" and total <= replica_max_params)):
            _init_from_whole(model, whole, device, seed)
            return "init: whole model, this rank's stages kept (equals single-process init)"
        seed = seed * 1_000_033 + pipeline.pp_rank  # each stage its own stream
    params = _dtensor_params(model)
    if not params:  # not sharded: every rank initialises the same full model
        torch.manual_seed(seed)
        _init_weights(model)
        return "init: full model on each rank"
    chosen = choose_mode(params, mode, replica_max_params)
    if chosen == "replica":
        _init_replica(model, params, device, seed)
        return "init: replica then shard (equals single-process init)"
    _init_sharded(model, params, device, seed)
    return "init: sharded in place (deterministic per mesh)"

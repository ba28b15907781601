"""The device mesh: ``(pp, dp_replicate, dp_shard, cp, tp)``, pipeline outermost, tensor parallel
innermost.

``tp`` ranks split every block's heads and hidden units (``kiln.parallelisms.tensor_parallel``);
they see the same batch. ``cp`` groups of them split every sequence of that batch (context
parallel, ``kiln.parallelisms.context_parallel``: each holds a head and a tail chunk, keys and
values are all-gathered). ``dp_shard`` groups of those share one copy of the model (FSDP2 shards
parameters, gradients and optimizer state over them, and over ``cp``: its ranks train different
tokens of the same rows, as torchtitan's ``dp_shard_cp``); ``dp_replicate`` such groups hold
replicas (HSDP: gradients all-reduced across them). The product must be the world size. Tensor
parallel is innermost so that its ranks are neighbours (one node: its collectives run every
layer), context parallel next (a K/V all-gather per layer). ``pp`` such slices each hold one
part of the layers (pipeline parallel, ``kiln.parallelisms.pipeline.stages``); activations pass
between
them point to point, the least traffic of all, so it is outermost (it may cross slow links). The
process group itself (gloo on CPU, nccl on CUDA, or ``parallelism.backend``) is created by
``kiln.components.distributed.init`` before this.

Dimensions are named (``MESH_DIMS``, outermost first); rank ``r``'s index in each is its
mixed-radix digit (``Layout.coordinate``), so a new dimension is one more name and size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.components.errors import RecipeError
from kiln.parallelisms.config import ParallelismConfig

if TYPE_CHECKING:  # torch.distributed's mesh is imported when a mesh is built (start-up time)
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    """How many ranks each mesh dimension has."""

    dp_replicate: int
    dp_shard: int
    tp: int = 1
    ep: int = 1  # borrowed from the data-parallel ranks: experts split over ep of them
    cp: int = 1
    pp: int = 1  # pipeline stages' rank groups, outermost: each holds the other dims' ranks

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def stage_ranks(self) -> int:
        """Ranks of one pipeline slice (the whole world without pipeline parallelism)."""
        return self.world_size // self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each sees its own slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def grad_ranks(self) -> int:
        """Ranks whose gradients are averaged: each trains different tokens (dp x cp)."""
        return self.dp * self.cp

    def coordinate(self, rank: int, dim: str) -> int:
        """``rank``'s index along mesh dimension ``dim`` (row-major over ``MESH_DIMS``)."""
        i = MESH_DIMS.index(dim)
        return rank // math.prod(self.shape[i + 1:]) % self.shape[i]

    def dp_rank(self, rank: int) -> int:
        """The slice of the global batch ``rank`` trains on (its context- and tensor-parallel
        peers share it, and its pipeline peers, which hold the other stages)."""
        return rank % self.stage_ranks // (self.cp * self.tp)

    def pp_rank(self, rank: int) -> int:
        """The pipeline slice ``rank`` belongs to (0 without pipeline parallelism)."""
        return self.coordinate(rank, "pp")

    @property
    def shape(self) -> tuple[int, ...]:
        """Sizes in ``MESH_DIMS`` order."""
        return self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp

    def describe(self) -> str:
        dims = " x ".join(f"{n} {s}" for n, s in zip(MESH_DIMS, self.shape, strict=True)
                          if n not in ("pp", "cp") or s > 1)
        experts = f" (experts over ep {self.ep} of the dp ranks)" if self.ep > 1 else ""
        return f"{dims} = {self.world_size} ranks{experts}"


def layout(cfg: ParallelismConfig, world_size: int) -> Layout:
    """The mesh for ``world_size`` ranks; a RecipeError naming the keys if they do not fit."""
    if world_size % cfg.pp:
        raise RecipeError(
            f"parallelism.pp = {cfg.pp} does not divide the world size {world_size}; use a "
            f"divisor of {world_size} (each pipeline stage gets world size / pp ranks)"
        )
    named = (f"the world size {world_size}" if cfg.pp == 1 else
             f"the ranks of one pipeline stage {world_size // cfg.pp} (world size {world_size} / "
             f"parallelism.pp {cfg.pp})")
    shape = _data_layout(cfg, world_size // cfg.pp, named)
    if shape.dp % cfg.ep:
        raise RecipeError(
            f"parallelism.ep = {cfg.ep} does not divide the data-parallel size {shape.dp} "
            f"(world size {world_size} / {_inner(shape)}); expert parallelism splits the experts "
            f"over data-parallel ranks: use a divisor of {shape.dp}"
        )
    if cfg.ep > 1 and shape.cp > 1:
        raise RecipeError(
            f"parallelism.ep = {cfg.ep} with parallelism.cp = {shape.cp} is not supported: the "
            "expert mesh groups data-parallel ranks of one tensor-parallel index and does not "
            "place context-parallel peers yet; use ep = 1 or cp = 1")
    return Layout(shape.dp_replicate, shape.dp_shard, shape.tp, cfg.ep, shape.cp, cfg.pp)


def _inner(shape: Layout) -> str:
    """"cp 2 x tp 4" (the dims inside data parallel that are in use), or "tp 1"."""
    used = [f"{n} {s}" for n, s in (("cp", shape.cp), ("tp", shape.tp)) if s > 1]
    return " x ".join(used) or "tp 1"


def _data_layout(cfg: ParallelismConfig, world_size: int, named: str) -> Layout:
    """The (dp_replicate, dp_shard, cp, tp) slice of ``world_size`` ranks (one pipeline
    stage's; ``named``: how messages call that number)."""
    rep, tp, cp = cfg.dp_replicate, cfg.tp, cfg.cp
    if cfg.dp_shard == 0:
        raise RecipeError("parallelism.dp_shard = 0 is not valid; use -1 (auto) or a degree >= 1")
    if world_size % tp:
        raise RecipeError(
            f"parallelism.tp = {tp} does not divide {named}; use a divisor of {world_size} "
            "(usually the GPUs of one node)"
        )
    if (world_size // tp) % cp:
        valid = [d for d in range(1, world_size // tp + 1) if (world_size // tp) % d == 0]
        raise RecipeError(
            f"parallelism.cp = {cp} does not divide {named}"
            + (f" / tp {tp}" if tp > 1 else "") + f"; valid values: {valid}"
        )
    inner = tp * cp
    if cfg.dp_shard == -1:
        if (world_size // inner) % rep:
            raise RecipeError(
                f"parallelism.dp_replicate = {rep} does not divide {named}"
                + (f" / ({_inner(Layout(1, 1, tp, cp=cp))})" if inner > 1 else "")
                + f"; use a divisor of {world_size // inner} (dp_shard = -1 takes the rest)"
            )
        return Layout(rep, world_size // inner // rep, tp, cp=cp)
    if rep * cfg.dp_shard * inner != world_size:
        inner_text = "".join(f" x {n} ({s})" for n, s in (("cp", cp), ("tp", tp)) if s > 1)
        raise RecipeError(
            f"parallelism.dp_replicate ({rep}) x dp_shard ({cfg.dp_shard}){inner_text} = "
            f"{rep * cfg.dp_shard * inner}, but "
            + (f"the world size is {world_size}" if cfg.pp == 1 else f"{named} is the target")
            + "; make the product equal it, or set dp_shard = -1 to derive it"
        )
    return Layout(rep, cfg.dp_shard, tp, cp=cp)


def mesh_shape(cfg: ParallelismConfig, world_size: int) -> tuple[int, ...]:
    """Sizes of ``MESH_DIMS`` for ``world_size`` ranks (see ``layout``)."""
    return layout(cfg, world_size).shape


def build_mesh(cfg: ParallelismConfig, world_size: int, device_type: str) -> DeviceMesh:
    """A mesh named ``MESH_DIMS`` over the initialised process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, mesh_shape(cfg, world_size), mesh_dim_names=MESH_DIMS)


def expert_mesh(shape: Layout, device_type: str) -> DeviceMesh:
    """A 2-D mesh ("ep_replicate", "ep"): ``ep`` groups neighbouring data-parallel ranks (same
    tensor-parallel index), ``ep_replicate`` all ranks holding the same experts (every other
    data-parallel rank and every tensor-parallel peer), over which expert gradients are summed.
    With pipeline stages both stay within this rank's stage (its layers are its own)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(shape.world_size).view(shape.pp, shape.dp // shape.ep, shape.ep,
                                                shape.tp)  # cp 1
    grid = ranks.transpose(2, 3).reshape(shape.pp, -1, shape.ep)
    if shape.pp == 1:
        return DeviceMesh(device_type, grid[0], mesh_dim_names=("ep_replicate", "ep"))
    mesh = DeviceMesh(device_type, grid, mesh_dim_names=("pp", "ep_replicate", "ep"))
    return mesh["ep_replicate", "ep"]


def _shard_dim(mesh: DeviceMesh) -> tuple[DeviceMesh, str]:
    """The dimension FSDP2 shards over: ``dp_shard``, or ``dp_shard`` x ``cp`` flattened."""
    if mesh["cp"].size() == 1:
        return mesh["dp_shard"], "dp_shard"
    return _flat(mesh, ("dp_shard", "cp"), "dp_shard_cp"), "dp_shard_cp"


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 uses: 1-D (shard, with cp folded in) without replication, 2-D (HSDP)
    with it."""
    shard, name = _shard_dim(mesh)
    if mesh["dp_replicate"].size() == 1:
        return shard
    return mesh["dp_replicate", name]


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """All ranks training different tokens (data parallel and context parallel) as one
    dimension: gradient averaging without FSDP."""
    used = [n for n in ("dp_replicate", "dp_shard", "cp") if mesh[n].size() > 1]
    if len(used) <= 1:
        return mesh[used[0] if used else "dp_shard"]
    return _flat(mesh, tuple(used), "dp_cp")


def _flat(mesh: DeviceMesh, dims: tuple[str, ...], name: str) -> DeviceMesh:
    """``dims`` of ``mesh`` flattened into one dimension ``name`` (torch returns the same mesh
    when asked again; slicing it from the root is deprecated)."""
    return mesh[dims]._flatten(name)

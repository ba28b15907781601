"""The device mesh: ``(dp_replicate, dp_shard, tp)``, tensor parallel innermost.

``tp`` ranks split every block's heads and hidden units (``kiln.parallelisms.tensor_parallel``);
they see the same batch. ``dp_shard`` groups of them share one copy of the model (FSDP2 shards
parameters, gradients and optimizer state over them); ``dp_replicate`` such groups hold replicas
(HSDP: gradients all-reduced across them). The product must be the world size. Tensor parallel is
innermost so that its ranks are neighbours (one node: its collectives run every layer). The
process group itself (gloo on CPU, nccl on CUDA, or ``parallelism.backend``) is created by
``kiln.components.distributed.init`` before this.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kiln.components.errors import RecipeError
from kiln.parallelisms.config import ParallelismConfig

if TYPE_CHECKING:  # torch.distributed's mesh is imported when a mesh is built (start-up time)
    from torch.distributed.device_mesh import DeviceMesh

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class Layout:
    """How many ranks each mesh dimension has."""

    dp_replicate: int
    dp_shard: int
    tp: int = 1
    ep: int = 1  # borrowed from the data-parallel ranks: experts split over ep of them

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each sees its own slice of the global batch."""
        return self.dp_replicate * self.dp_shard

    def dp_rank(self, rank: int) -> int:
        """The slice of the global batch ``rank`` trains on (its tensor-parallel peers share it)."""
        return rank // self.tp

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.dp_replicate, self.dp_shard, self.tp

    def describe(self) -> str:
        dims = " x ".join(f"{n} {s}" for n, s in zip(MESH_DIMS, self.shape, strict=True))
        experts = f" (experts over ep {self.ep} of the dp ranks)" if self.ep > 1 else ""
        return f"{dims} = {self.world_size} ranks{experts}"


def layout(cfg: ParallelismConfig, world_size: int) -> Layout:
    """The mesh for ``world_size`` ranks; a RecipeError naming the keys if they do not fit."""
    shape = _data_layout(cfg, world_size)
    if shape.dp % cfg.ep:
        raise RecipeError(
            f"parallelism.ep = {cfg.ep} does not divide the data-parallel size {shape.dp} "
            f"(world size {world_size} / tp {shape.tp}); expert parallelism splits the experts "
            f"over data-parallel ranks: use a divisor of {shape.dp}"
        )
    return Layout(shape.dp_replicate, shape.dp_shard, shape.tp, cfg.ep)


def _data_layout(cfg: ParallelismConfig, world_size: int) -> Layout:
    rep, tp = cfg.dp_replicate, cfg.tp
    if cfg.dp_shard == 0:
        raise RecipeError("parallelism.dp_shard = 0 is not valid; use -1 (auto) or a degree >= 1")
    if world_size % tp:
        raise RecipeError(
            f"parallelism.tp = {tp} does not divide the world size {world_size}; use a divisor "
            f"of {world_size} (usually the GPUs of one node)"
        )
    if cfg.dp_shard == -1:
        if (world_size // tp) % rep:
            raise RecipeError(
                f"parallelism.dp_replicate = {rep} does not divide the world size {world_size}"
                + (f" / tp {tp}" if tp > 1 else "") + f"; use a divisor of {world_size // tp} "
                "(dp_shard = -1 takes the rest)"
            )
        return Layout(rep, world_size // tp // rep, tp)
    if rep * cfg.dp_shard * tp != world_size:
        tp_text = f" x tp ({tp})" if tp > 1 else ""
        raise RecipeError(
            f"parallelism.dp_replicate ({rep}) x dp_shard ({cfg.dp_shard}){tp_text} = "
            f"{rep * cfg.dp_shard * tp}, but the world size is {world_size}; make the product "
            "equal the number of processes, or set dp_shard = -1 to derive it"
        )
    return Layout(rep, cfg.dp_shard, tp)


def mesh_shape(cfg: ParallelismConfig, world_size: int) -> tuple[int, int, int]:
    """(dp_replicate, dp_shard, tp) for ``world_size`` ranks (see ``layout``)."""
    return layout(cfg, world_size).shape


def build_mesh(cfg: ParallelismConfig, world_size: int, device_type: str) -> DeviceMesh:
    """A 3-D mesh named ("dp_replicate", "dp_shard", "tp") over the initialised process group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, mesh_shape(cfg, world_size), mesh_dim_names=MESH_DIMS)


def expert_mesh(shape: Layout, device_type: str) -> DeviceMesh:
    """A 2-D mesh ("ep_replicate", "ep"): ``ep`` groups neighbouring data-parallel ranks (same
    tensor-parallel index), ``ep_replicate`` all ranks holding the same experts (every other
    data-parallel rank and every tensor-parallel peer), over which expert gradients are summed."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(shape.world_size).view(shape.dp // shape.ep, shape.ep, shape.tp)
    grid = ranks.transpose(1, 2).reshape(-1, shape.ep)
    return DeviceMesh(device_type, grid, mesh_dim_names=("ep_replicate", "ep"))


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 uses: 1-D (shard) without replication, 2-D (HSDP) with it."""
    if mesh["dp_replicate"].size() == 1:
        return mesh["dp_shard"]
    return mesh["dp_replicate", "dp_shard"]


def dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """All data-parallel ranks as one dimension (gradient averaging without FSDP)."""
    if mesh["dp_replicate"].size() == 1:
        return mesh["dp_shard"]
    return mesh["dp_replicate", "dp_shard"]._flatten("dp")

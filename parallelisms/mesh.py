"""The data-parallel device mesh: ``(dp_replicate, dp_shard)``.

``dp_shard`` ranks share one copy of the model (FSDP2 shards parameters, gradients and optimizer
state over them); ``dp_replicate`` such groups hold replicas (HSDP: gradients all-reduced across
them). Their product must be the world size. The process group itself (gloo on CPU, nccl on
CUDA, or ``parallelism.backend``) is created by ``kiln.components.distributed.init`` before this.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from kiln.components.errors import RecipeError
from kiln.parallelisms.config import ParallelismConfig

MESH_DIMS = ("dp_replicate", "dp_shard")


def mesh_shape(cfg: ParallelismConfig, world_size: int) -> tuple[int, int]:
    """(dp_replicate, dp_shard) for ``world_size`` ranks; a RecipeError if they do not fit."""
    rep = cfg.dp_replicate
    if cfg.dp_shard == 0:
        raise RecipeError("parallelism.dp_shard = 0 is not valid; use -1 (auto) or a degree >= 1")
    if cfg.dp_shard == -1:
        if world_size % rep:
            raise RecipeError(
                f"parallelism.dp_replicate = {rep} does not divide the world size {world_size}; "
                f"use a divisor of {world_size} (dp_shard = -1 takes the rest)"
            )
        return rep, world_size // rep
    if rep * cfg.dp_shard != world_size:
        raise RecipeError(
            f"parallelism.dp_replicate ({rep}) x dp_shard ({cfg.dp_shard}) = "
            f"{rep * cfg.dp_shard}, but the world size is {world_size}; make the product equal "
            "the number of processes, or set dp_shard = -1 to derive it"
        )
    return rep, cfg.dp_shard


def build_mesh(cfg: ParallelismConfig, world_size: int, device_type: str) -> DeviceMesh:
    """A 2-D mesh named ("dp_replicate", "dp_shard") over the initialised process group."""
    shape = mesh_shape(cfg, world_size)
    return init_device_mesh(device_type, shape, mesh_dim_names=MESH_DIMS)


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh FSDP2 uses: 1-D (shard) without replication, 2-D (HSDP) with it."""
    if mesh["dp_replicate"].size() == 1:
        return mesh["dp_shard"]
    return mesh

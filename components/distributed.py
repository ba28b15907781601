"""Process-group setup and the collectives kiln uses (torchrun environment).

A leaf module: every package may import it; it imports only ``kiln.components.errors``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.components.errors import RecipeError


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise RecipeError("training.device = \"cuda\" but CUDA is not available; use \"auto\"")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init(device_choice: str = "auto", backend: str = "auto") -> World:
    """Join the torchrun process group if there is one (WORLD_SIZE > 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        if backend == "auto":
            backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend=backend, timeout=datetime.timedelta(minutes=int(os.environ.get(
                "KILN_DIST_TIMEOUT_MIN", "30"))),
            device_id=device if device.type == "cuda" else None,
        )
    return World(rank, world_size, local_rank, device)


def shutdown(*, together: bool = True) -> None:
    """Leave the process group. ``together``: first wait (bounded) until every rank is here,
    because a rank tearing down gloo connections that a peer still uses can abort the peer
    ("terminate called without an active exception"). Pass False when leaving on an error."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if together and dist.get_world_size() > 1:
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=120))
        else:
            dist.barrier()
    dist.destroy_process_group()


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def all_reduce_(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
                               "min": dist.ReduceOp.MIN}[op])
    return t


def broadcast_object(obj):
    if dist.is_available() and dist.is_initialized():
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj

"""Layout planning without the cluster (``kiln validate RECIPE --world-size N``).

``dry_parallelize`` applies the real ``parallelize`` to a model built on the meta device inside a
fake process group of N ranks (torch's ``fake`` backend: every collective is a no-op), so the
mesh, the refusals and each rank's local shard shapes are exactly those of the real run, with no
memory and no processes. Compile and float8 are left out (they do not change what a rank holds).
``local_bytes`` then reads rank 0's share (FSDP2 pads the last shards: rank 0 holds the most).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.components.errors import KilnError
from kiln.parallelisms.config import ParallelismConfig
from kiln.parallelisms.parallelize import ParallelPlan, parallelize


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """A process group of ``world_size`` fake ranks (this process is rank 0), torn down after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise KilnError("layout planning needs its own (fake) process group; run it outside "
                        "torchrun (kiln validate, not NGPU=N)")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def dry_parallelize(model: nn.Module, cfg: ParallelismConfig, world_size: int, *,
                    rank: int = 0, training=None, grad_accum: int = 1) -> ParallelPlan:
    """``parallelize`` a meta ``model`` for ``world_size`` ranks (call inside ``fake_world``).
    ``rank`` picks the pipeline stage(s) to keep (its data-parallel shards are rank 0's)."""
    dry = cfg.model_copy(update={"compile": False, "compile_loss": False, "float8": "off"})
    world = SimpleNamespace(world_size=world_size, rank=rank, device=torch.device("cpu"))
    return parallelize(model, dry, world, training=training, grad_accum=grad_accum)


def local_numel(p: torch.Tensor) -> int:
    return p.to_local().numel() if isinstance(p, DTensor) else p.numel()


def local_bytes(params: Iterable[torch.Tensor]) -> int:
    """Bytes rank 0 holds of ``params`` (distinct tensors; a DTensor's local shard)."""
    seen: dict[int, torch.Tensor] = {id(p): p for p in params}
    return sum(local_numel(p) * p.element_size() for p in seen.values())

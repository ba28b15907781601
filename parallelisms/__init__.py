"""Parallelisms: float8, activation checkpointing, torch.compile and FSDP2, in that order.

``parallelize(model, cfg, world)`` is the entry point; ``materialize`` initialises a meta-built
model; ``build_mesh`` makes the (dp_replicate, dp_shard) mesh; ``clip_grad_norm``,
``grad_sync_context`` and ``all_reduce_grads`` are the per-step gradient calls.
"""

from kiln.parallelisms.config import ParallelismConfig
from kiln.parallelisms.grads import all_reduce_grads, clip_grad_norm, grad_norm, grad_sync_context
from kiln.parallelisms.mesh import build_mesh, mesh_shape
from kiln.parallelisms.meta_init import materialize
from kiln.parallelisms.parallelize import ParallelPlan, parallelize

__all__ = [
    "ParallelPlan",
    "ParallelismConfig",
    "all_reduce_grads",
    "build_mesh",
    "clip_grad_norm",
    "grad_norm",
    "grad_sync_context",
    "materialize",
    "mesh_shape",
    "parallelize",
]

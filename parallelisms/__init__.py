"""Parallelisms: float8, activation checkpointing, torch.compile and FSDP2, in that order.

``parallelize(model, cfg, world)`` is the entry point; ``materialize`` initialises a meta-built
model; ``build_mesh`` makes the (dp_replicate, dp_shard) mesh; ``clip_grad_norm``,
``grad_sync_context`` and ``all_reduce_grads`` are the per-step gradient calls.
"""

import importlib

from kiln.parallelisms.config import ParallelismConfig
from kiln.parallelisms.grads import all_reduce_grads, clip_grad_norm, grad_norm, grad_sync_context
from kiln.parallelisms.meta_init import materialize
from kiln.parallelisms.parallelize import ParallelPlan, parallelize


def __getattr__(name: str):
    # The mesh helpers import torch.distributed's device mesh: on first use only, so that
    # single-process runs never load FSDP2 / DTensor (about 1 s less to the first step).
    if name in ("build_mesh", "mesh_shape"):
        return getattr(importlib.import_module("kiln.parallelisms.layout.mesh"), name)
    raise AttributeError(f"module 'kiln.parallelisms' has no attribute {name!r}")


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

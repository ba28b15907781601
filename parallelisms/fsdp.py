"""FSDP2 (``fully_shard``): each block is one communication unit, then the root.

Gradient division: FSDP2 reduce-scatters (and, with HSDP, all-reduces) gradients as a *mean*
over the data-parallel ranks. Each rank's loss is the mean over its own tokens (divided by the
number of micro-batches under accumulation), so with equal tokens per rank the synchronised
gradient is the gradient of the global mean loss, exactly what one process computes on the whole
global batch. The non-FSDP path (``kiln.parallelisms.grads.all_reduce_grads``) keeps the same rule.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kiln.parallelisms.blocks import model_blocks
from kiln.parallelisms.config import ParallelismConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def reshard_policy(cfg: ParallelismConfig, index: int, n_blocks: int) -> bool:
    """Whether block ``index`` frees its gathered parameters after forward."""
    if cfg.reshard_after_forward == "always":
        return True
    if cfg.reshard_after_forward == "never":
        return False
    # The last block's backward runs first, right after forward: keep it gathered.
    return index < n_blocks - 1


def apply_fsdp(model: nn.Module, cfg: ParallelismConfig, mesh: DeviceMesh,
               ignored: set[nn.Parameter] | None = None,
               roots: list[nn.Module] | None = None) -> None:
    """``fully_shard`` every block, then the root (embeddings, final norm, head, the rest);
    ``ignored`` parameters (expert-parallel weights) are left as they are. ``roots``: the
    modules to shard last instead of ``model`` (pipeline stages: one root each)."""
    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[cfg.param_dtype], reduce_dtype=DTYPES[cfg.reduce_dtype]
    )
    blocks = model_blocks(model)
    for i, block in enumerate(blocks):
        fully_shard(
            block, mesh=mesh, mp_policy=mp,
            reshard_after_forward=reshard_policy(cfg, i, len(blocks)),
            ignored_params=ignored or None,
        )
    # The root keeps its parameters gathered after forward (FSDP2's root heuristic: the head's
    # backward is the first thing backward does).
    for root in roots or [model]:
        fully_shard(root, mesh=mesh, mp_policy=mp, ignored_params=ignored or None)


def reshard_after_every_forward(model: nn.Module) -> None:
    """For a model that never runs backward (a frozen reference): free every gathered
    parameter after each forward, the root's and the last block's included (FSDP2 keeps those
    gathered for a backward that never comes)."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if sharded:
        def reshard(module, args, output):
            for m in sharded:
                m.reshard()
            return output

        model.register_forward_hook(reshard)


def fsdp_summary(cfg: ParallelismConfig, mesh: DeviceMesh) -> str:
    rep, shard, cp = mesh["dp_replicate"].size(), mesh["dp_shard"].size(), mesh["cp"].size()
    kind = "HSDP" if rep > 1 else "FSDP2"
    shards = f"{shard * cp} (dp_shard {shard} x cp {cp})" if cp > 1 else f"{shard}"
    text = f"{kind} over {rep * shard * cp} ranks (shard {shards} x replicate {rep})"
    if cfg.param_dtype != "float32" or cfg.reduce_dtype != "float32":
        text += f", params {cfg.param_dtype}, grads reduced in {cfg.reduce_dtype}"
    return text

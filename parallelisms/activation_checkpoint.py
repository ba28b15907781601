"""Activation checkpointing: trade recomputation in backward for activation memory.

- ``full``: every block keeps only its input; everything inside is recomputed in backward.
- ``selective`` (layer level): the same for every ``ac_every``-th block (blocks N-1, 2N-1, ...,
  like torchtitan), the others keep all their activations.
- ``selective`` with ``ac_ops`` (op level): every block is wrapped, but the outputs of the
  expensive ops (matmuls, attention) are saved and only the cheap element-wise ops are recomputed
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    checkpoint_wrapper,
)
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from kiln.parallelisms.blocks import model_blocks, replace_block
from kiln.parallelisms.config import ParallelismConfig

# Ops whose outputs op-level selective AC saves (the rest is recomputed). Names that a torch
# build lacks are skipped.
_SAVE_OPS = (
    "mm.default",
    "addmm.default",
    "bmm.default",
    "_scaled_mm.default",
    "_scaled_dot_product_flash_attention.default",
    "_scaled_dot_product_efficient_attention.default",
    "_scaled_dot_product_cudnn_attention.default",
    "_scaled_dot_product_flash_attention_for_cpu.default",
)


def save_list() -> list:
    ops = []
    for name in _SAVE_OPS:
        packet, overload = name.split(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is not None:
            ops.append(op)
    return ops


def _wrap(block: nn.Module, op_level: bool) -> nn.Module:
    kwargs = {}
    if op_level:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, save_list())
    # Non-reentrant: works with FSDP2, torch.compile and inputs that do not require grad.
    return checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **kwargs)


def apply_activation_checkpoint(model: nn.Module, cfg: ParallelismConfig) -> str:
    """Wrap the chosen blocks in place; return a description ("" when off)."""
    mode = cfg.activation_checkpoint
    if mode == "none":
        return ""
    blocks = model_blocks(model)
    op_level = mode == "selective" and cfg.ac_ops
    wrapped = 0
    for i, block in enumerate(blocks):
        layer_level = mode == "selective" and not cfg.ac_ops
        if layer_level and (i + 1) % cfg.ac_every:
            continue
        replace_block(model, i, _wrap(block, op_level))
        wrapped += 1
    if mode == "full":
        return f"activation checkpointing full ({wrapped} blocks)"
    if op_level:
        return f"activation checkpointing selective op-level ({wrapped} blocks, matmuls saved)"
    nth = {1: "", 2: "2nd ", 3: "3rd "}.get(cfg.ac_every, f"{cfg.ac_every}th ")
    return f"activation checkpointing selective every {nth}block ({wrapped} of {len(blocks)})"

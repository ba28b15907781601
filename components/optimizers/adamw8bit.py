"""8-bit AdamW: both moments stored block-wise quantised (torchao.optim.AdamW8bit).

Why torchao and not bitsandbytes (measured on CPU, torch 2.13, torchao 0.18, bnb 0.50.2):
the same optimizer-state memory (both keep uint8 codes + an fp32 scale per 256-block, ~2 bytes
per parameter against fp32 AdamW's 8); comparable step time on CPU; but only torchao works with
FSDP2 — its state is a DTensor wrapping the 8-bit subclass and round-trips exactly through DCP
(`get/set_optimizer_state_dict`), while bnb's step fails on DTensor parameters ("mixed
torch.Tensor and DTensor"). So bitsandbytes is not offered.

Three torchao details handled here: its update is one ``torch.compile``d function per parameter
shape (a first-step compile cost, paid once per shape; ``compile = false`` runs it eagerly); it
keeps each group's LR as a tensor, refusing a float (kiln's trainer assigns float LRs from the
schedule, so ``step`` converts them); and it cuts each rank's *local* shard into blocks, so
which tensors are quantised, and where the blocks fall, would depend on the number of processes:
a (258, 128) embedding is 8-bit on one process but fp32 on two (129 x 128 is not a multiple of
256), and DCP cannot reshard a block that straddles two shards (torchao refuses such a slice).
kiln therefore decides per *global* tensor (``state_layout``): matrices (and stacks) of >= 4096
elements are quantised in blocks that never cross a row (the largest divisor of the row length
up to ``block_size``), so every dim-0 sharding (FSDP2 over any number of ranks, HSDP, one
process) holds the same blocks and DCP reshards the state natively; 1-D tensors and rows with no
divisor >= 32 keep fp32 moments.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch
from pydantic import Field

from kiln.components.optimizers.common import AdamFamilyConfig
from kiln.components.registry import register
from kiln.components.torchao_import import import_torchao, quiet_compile


class AdamW8bitConfig(AdamFamilyConfig):
    # measured with torch 2.13 and torchao 0.18: the save failed at its first checkpoint
    async_save_problem: ClassVar[str] = (
        "DCP's background save copies each state tensor first (zeros_like), which torchao's "
        "8-bit state (OptimState8bit) does not implement")
    eps: float = Field(1e-8, gt=0, description="denominator epsilon")
    block_size: int = Field(
        256, ge=32, description="largest quantisation block; a matrix uses the largest divisor "
        "of its row length up to this, so blocks never cross a row"
    )
    bf16_stochastic_round: bool = Field(
        False, description="stochastic rounding when writing bf16 parameters"
    )
    compile: bool = Field(
        True, description="torch.compile the update, as torchao does (a compile per parameter "
        "shape on the first step); false: eager, no first-step compile, slower later steps"
    )


MIN_BLOCK = 32


def state_layout(p: torch.Tensor, block_size: int) -> int | None:
    """Block size for ``p``'s 8-bit moments, or None for fp32 moments; decided from the global
    shape, so it is the same for every sharding along dim 0."""
    if p.ndim < 2 or p.numel() < 4096:
        return None
    row = p.numel() // p.shape[0]
    return next((b for b in range(min(block_size, row), MIN_BLOCK - 1, -1) if row % b == 0), None)


def _row_sharded(p: torch.Tensor) -> bool:
    """Plain, replicated, or sharded along dim 0 only (FSDP2 / HSDP): local rows are whole."""
    from torch.distributed.tensor import DTensor, Shard  # not at import: recipes load lightly

    if not isinstance(p, DTensor):
        return True
    return all(not isinstance(pl, Shard) or pl.dim == 0 for pl in p.placements)


@functools.cache
def adamw8bit_class() -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit accepting float LRs; imported on first use (torchao loads slowly)."""
    TorchaoAdamW8bit = import_torchao("torchao.optim").AdamW8bit  # noqa: N806

    class AdamW8bit(TorchaoAdamW8bit):
        """torchao's AdamW8bit accepting float LRs set by the schedule, with layout-independent
        quantisation blocks (``state_layout``)."""

        def _new_buffer(self, p: torch.Tensor, signed: bool) -> torch.Tensor:
            from torch.distributed.tensor import DTensor

            if not _row_sharded(p):  # other layouts (e.g. tensor parallel): torchao's own rule
                return super()._new_buffer(p, signed)
            local = p.to_local() if isinstance(p, DTensor) else p
            block = state_layout(p, self.block_size)
            if block is None or local.numel() == 0:
                out = torch.zeros_like(local)
            else:
                out = self._subclass_zeros(local, signed, block)
            if isinstance(p, DTensor):  # local shapes may differ across ranks (uneven shards)
                out = DTensor.from_local(out, p.device_mesh, p.placements, run_check=False,
                                         shape=p.shape, stride=p.stride())
            return out.to(p.device)

        compile_update = True  # set by build_adamw8bit from the config

        @torch.no_grad()
        def step(self, closure=None):
            if not self.compile_update:  # torchao's torch.compile call runs the function as is
                with torch.compiler.set_stance("force_eager"):
                    return self._step(closure)
            quiet_compile()  # torchao compiles the step on first use
            return self._step(closure)

        def _step(self, closure):
            for group in self.param_groups:
                if not isinstance(group["lr"], torch.Tensor):
                    group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
            # torch 2.13's on-disk AOT autograd cache keys a compiled function by its graph over
            # the *outer* tensors: it cannot hash the 8-bit subclass's inner tensors (it warns
            # so). Two states with the same outer shape but different inner shapes (the
            # uneven shards of one DTensor on two ranks; another number of ranks; another
            # block size) then share an entry, and a process runs code compiled for other
            # shapes: "expected size 1==2" or a segfault (measured, 2 gloo processes). Only
            # that cache is bypassed: the in-memory cache and inductor's FX graph cache (keyed
            # by the real inner shapes) still avoid recompiling.
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return super().step(closure)

    return AdamW8bit


@register("optimizer", "adamw8bit", config=AdamW8bitConfig)
def build_adamw8bit(cfg: AdamW8bitConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """AdamW with 8-bit block-quantised moments (torchao), FSDP2- and DCP-compatible."""
    optimizer = adamw8bit_class()(
        groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
        weight_decay=cfg.weight_decay, block_size=cfg.block_size,
        bf16_stochastic_round=cfg.bf16_stochastic_round,
    )
    optimizer.compile_update = cfg.compile
    return optimizer

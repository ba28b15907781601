"""8-bit AdamW: both moments stored block-wise quantised (torchao.optim.AdamW8bit).

Why torchao and not bitsandbytes (measured on CPU, torch 2.13, torchao 0.18, bnb 0.50.2):
the same optimizer-state memory (both keep uint8 codes + an fp32 scale per 256-block, ~2 bytes
per parameter against fp32 AdamW's 8); comparable step time on CPU; but only torchao works with
FSDP2 — its state is a DTensor wrapping the 8-bit subclass and round-trips exactly through DCP
(`get/set_optimizer_state_dict`), while bnb's step fails on DTensor parameters ("mixed
torch.Tensor and DTensor"). So bitsandbytes is not offered.

Two torchao details handled here: its update is one ``torch.compile``d function per parameter
shape (a first-step compile cost, paid once per shape), and it keeps each group's LR as a tensor,
refusing a float; kiln's trainer assigns float LRs from the schedule, so ``step`` converts them.
Tensors under 4096 elements or not divisible by ``block_size`` keep fp32 moments (torchao rule).
"""

from __future__ import annotations

import functools

import torch
from pydantic import Field

from kiln.components.optimizers.common import OptimizerConfig
from kiln.components.registry import register
from kiln.components.torchao_import import import_torchao, quiet_compile


class AdamW8bitConfig(OptimizerConfig):
    betas: list[float] = Field(
        default_factory=lambda: [0.9, 0.95], min_length=2, max_length=2,
        description="[beta1, beta2]",
    )
    eps: float = Field(1e-8, gt=0, description="denominator epsilon")
    block_size: int = Field(256, ge=32, description="elements per quantisation block")
    bf16_stochastic_round: bool = Field(
        False, description="stochastic rounding when writing bf16 parameters"
    )


@functools.cache
def adamw8bit_class() -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit accepting float LRs; imported on first use (torchao loads slowly)."""
    TorchaoAdamW8bit = import_torchao("torchao.optim").AdamW8bit  # noqa: N806

    class AdamW8bit(TorchaoAdamW8bit):
        """torchao's AdamW8bit accepting float LRs set by the schedule."""

        @torch.no_grad()
        def step(self, closure=None):
            quiet_compile()  # torchao compiles the step on first use
            for group in self.param_groups:
                if not isinstance(group["lr"], torch.Tensor):
                    group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
            return super().step(closure)

    return AdamW8bit


@register("optimizer", "adamw8bit", config=AdamW8bitConfig)
def build_adamw8bit(cfg: AdamW8bitConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """AdamW with 8-bit block-quantised moments (torchao), FSDP2- and DCP-compatible."""
    return adamw8bit_class()(
        groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
        weight_decay=cfg.weight_decay, block_size=cfg.block_size,
        bf16_stochastic_round=cfg.bf16_stochastic_round,
    )

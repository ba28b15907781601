"""Linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math

from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.registry import register


class WarmupCosineConfig(ComponentConfig):
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps (from lr/warmup to lr)")
    warmup_fraction: float = Field(
        0.0, ge=0, le=1, description="warmup as a fraction of all steps (used if warmup_steps = 0)"
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="final LR as a fraction of the peak")


@register("schedule", "warmup_cosine")
class WarmupCosine:
    """Linear warmup to the peak LR, then cosine decay to min_lr_ratio x peak."""

    Config = WarmupCosineConfig

    def __init__(self, cfg: WarmupCosineConfig, *, total_steps: int):
        self.total = max(int(total_steps), 1)
        self.warmup = cfg.warmup_steps or round(cfg.warmup_fraction * self.total)
        self.floor = cfg.min_lr_ratio

    def __call__(self, step: int) -> float:
        """LR multiplier for optimizer step ``step`` (0-based)."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        span = max(self.total - self.warmup, 1)
        progress = min((step - self.warmup) / span, 1.0)
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))

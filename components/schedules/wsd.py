"""Warmup-stable-decay: warmup, a long constant phase, then a short decay."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.registry import register


class WSDConfig(ComponentConfig):
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    warmup_fraction: float = Field(
        0.0, ge=0, le=1, description="warmup as a fraction of all steps (used if warmup_steps = 0)"
    )
    decay_fraction: float = Field(
        0.2, ge=0, le=1, description="final fraction of steps spent decaying (the decay starts "
        "no earlier than the end of the warmup)"
    )
    decay_shape: Literal["linear", "cosine", "sqrt"] = Field("linear", description="decay curve")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final LR as a fraction of the peak")


@register("schedule", "wsd")
class WSD:
    """Warmup, hold the peak LR, decay over the last decay_fraction of training."""

    Config = WSDConfig

    def __init__(self, cfg: WSDConfig, *, total_steps: int):
        self.total = max(int(total_steps), 1)
        self.warmup = cfg.warmup_steps or round(cfg.warmup_fraction * self.total)
        # The decay starts at max(T - D, W), as the looped-MoE reference: when warmup and decay
        # together exceed the run, the decay is shortened, never started inside the warmup
        # (that made the LR jump down at the end of the warmup).
        self.decay_start = max(self.total - round(cfg.decay_fraction * self.total), self.warmup)
        self.decay = self.total - self.decay_start if cfg.decay_fraction else 0
        self.shape = cfg.decay_shape
        self.floor = cfg.min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        if step < self.decay_start or self.decay <= 0:
            return 1.0
        t = min((step - self.decay_start + 1) / self.decay, 1.0)  # 0 → 1 over the decay phase
        if self.shape == "linear":
            left = 1 - t
        elif self.shape == "cosine":
            left = 0.5 * (1 + math.cos(math.pi * t))
        else:
            left = 1 - math.sqrt(t)
        return self.floor + (1 - self.floor) * left

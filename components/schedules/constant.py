"""Constant LR after an optional linear warmup."""

from __future__ import annotations

from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.registry import register


class ConstantConfig(ComponentConfig):
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")


@register("schedule", "constant")
class Constant:
    """The peak LR throughout, after an optional linear warmup."""

    Config = ConstantConfig

    def __init__(self, cfg: ConstantConfig, *, total_steps: int):
        self.warmup = cfg.warmup_steps

    def __call__(self, step: int) -> float:
        return (step + 1) / self.warmup if step < self.warmup else 1.0

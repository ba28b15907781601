"""What a step returns, and what a guard decides."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class GuardDecision:
    """A guard's verdict on one (segment of a) step."""

    skip: bool = False
    abort: bool = False
    reason: str = ""


@dataclass
class StepResult:
    """One optimizer step's outcome. ``loss`` is the global mean over the step's tokens."""

    loss: float
    tokens: int  # tokens processed by all ranks in this step
    grad_norm: float | None = None
    skipped: bool = False
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)


def finite(t: torch.Tensor | None) -> bool:
    return t is None or bool(torch.isfinite(t).all())

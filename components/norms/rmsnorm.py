"""RMSNorm: scale by the root-mean-square of the features (no mean subtraction, no bias)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from kiln.components.base import ComponentConfig
from kiln.components.registry import register


class RMSNormConfig(ComponentConfig):
    eps: float = Field(1e-5, gt=0, description="added to the mean square (torchtitan llama3: 1e-5)")
    elementwise_affine: bool = Field(True, description="learn a per-channel weight (init 1)")


@register("norm", "rmsnorm")
class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), as in Llama: x / rms(x) * weight."""

    Config = RMSNormConfig

    def __init__(self, cfg: RMSNormConfig, *, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.eps = cfg.eps
        self.weight = nn.Parameter(torch.ones(dim)) if cfg.elementwise_affine else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim)
        w = self.weight
        if w is not None and w.dtype != x.dtype:
            # bf16 activations (autocast) with an fp32 weight: normalise in fp32, round once.
            return F.rms_norm(x.float(), (self.dim,), w.float(), self.eps).to(x.dtype)
        return F.rms_norm(x, (self.dim,), w, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, affine={self.weight is not None}"

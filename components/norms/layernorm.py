"""LayerNorm (Ba et al. 2016): subtract the mean, divide by the standard deviation, then scale
and shift per channel. GPT-2 learns both; ``bias = false`` keeps the scale only (PaLM has no
biases anywhere), and ``elementwise_affine = false`` with no bias is OLMo 1's non-parametric
LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from kiln.components.base import ComponentConfig
from kiln.components.registry import register


class LayerNormConfig(ComponentConfig):
    eps: float = Field(1e-5, gt=0, description="added to the variance (GPT-2: 1e-5)")
    elementwise_affine: bool = Field(True, description="learn a per-channel scale (init 1)")
    bias: bool = Field(True, description="learn a per-channel shift (init 0)")


@register("norm", "layernorm")
class LayerNorm(nn.Module):
    """LayerNorm: (x - mean) / std * weight + bias, each part optional."""

    Config = LayerNormConfig

    def __init__(self, cfg: LayerNormConfig, *, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.eps = cfg.eps
        self.weight = nn.Parameter(torch.ones(dim)) if cfg.elementwise_affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if cfg.bias else None

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim)
        w, b = self.weight, self.bias
        if any(p is not None and p.dtype != x.dtype for p in (w, b)):
            # bf16 activations (autocast) with fp32 parameters: normalise in fp32, round once.
            return F.layer_norm(x.float(), (self.dim,), None if w is None else w.float(),
                                None if b is None else b.float(), self.eps).to(x.dtype)
        return F.layer_norm(x, (self.dim,), w, b, self.eps)

    def extra_repr(self) -> str:
        return (f"{self.dim}, eps={self.eps}, affine={self.weight is not None}, "
                f"bias={self.bias is not None}")

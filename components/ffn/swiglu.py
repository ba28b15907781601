"""SwiGLU feed-forward (Shazeer 2020), sized by the Llama rule; torchtitan names w1/w3/w2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from kiln.components.base import ComponentConfig
from kiln.components.registry import register


class SwiGLUConfig(ComponentConfig):
    hidden_dim: int = Field(
        0, ge=0, description="hidden width (0 = Llama rule: 8*dim/3, times ffn_dim_multiplier, "
        "rounded up to multiple_of)"
    )
    multiple_of: int = Field(256, ge=1, description="round the Llama-rule width up to this")
    # bounded: 1e30 overflowed the weights' shape (a bare TypeError from torch.empty)
    ffn_dim_multiplier: float = Field(
        0.0, ge=0, le=64, description="scales the Llama-rule width before rounding (0 = none; "
        "Llama 3 8B uses 1.3)"
    )


def hidden_dim(cfg: SwiGLUConfig, dim: int) -> int:
    """The hidden width: explicit, or Llama's `int(2 * 4 * dim / 3)` scaled and rounded up."""
    if cfg.hidden_dim:
        return cfg.hidden_dim
    h = int(2 * (4 * dim) / 3)
    if cfg.ffn_dim_multiplier:
        h = int(cfg.ffn_dim_multiplier * h)
    return cfg.multiple_of * ((h + cfg.multiple_of - 1) // cfg.multiple_of)


@register("ffn", "swiglu")
class SwiGLU(nn.Module):
    """SwiGLU feed-forward: w2(silu(w1 x) * w3 x), Llama sizing."""

    Config = SwiGLUConfig

    def __init__(self, cfg: SwiGLUConfig, *, dim: int, layer_idx: int, n_layers: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_dim = hidden_dim(cfg, dim)
        self.w1 = nn.Linear(dim, self.hidden_dim, bias=False)  # gate
        self.w3 = nn.Linear(dim, self.hidden_dim, bias=False)  # up
        self.w2 = nn.Linear(self.hidden_dim, dim, bias=False)  # down

    def init_weights(self, std: float, out_std: float) -> None:
        """w1, w3 ~ N(0, std); the output projection w2 ~ N(0, out_std)."""
        for lin, s in ((self.w1, std), (self.w3, std), (self.w2, out_std)):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim)
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # hidden: (..., hidden_dim)

"""NoPE: no position encoding. q and k pass through unchanged; a causal decoder still tells
positions apart through its mask (Haviv et al. 2022; Kazemnejad et al. 2023, who find it
extrapolates to longer contexts better than RoPE in small models). The baseline for a new
position scheme, and the global layers of some hybrid models."""

from __future__ import annotations

import torch
from torch import nn

from kiln.components.base import ComponentConfig
from kiln.components.registry import register


class NoPositionConfig(ComponentConfig):
    pass


@register("position", "none")
class NoPosition(nn.Module):
    """No position encoding (NoPE): q and k as they are."""

    Config = NoPositionConfig

    def __init__(self, cfg: NoPositionConfig, *, head_dim: int, max_seq_len: int) -> None:
        super().__init__()

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None,
                limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The position component's call (``rope.RoPE.forward``): nothing to rotate."""
        return q, k

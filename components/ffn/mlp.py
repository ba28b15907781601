"""The two-layer MLP of GPT-2 and most pre-Llama models: ``w2(act(w1 x))``, with biases where
GPT-2 has them, and a choice of activation: exact GELU, GPT-2's tanh approximation, ReLU, or
squared ReLU (So et al. 2021, "Primer"; modded-nanogpt's speedruns use it).

Layer names follow SwiGLU's (``w1`` up, ``w2`` down), so tensor parallelism, float8 and the
optimizer routing rules treat both alike; there is no gate (``w3``).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from kiln.components.base import ComponentConfig
from kiln.components.registry import register


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU: relu(x) ** 2."""
    return F.relu(x).square()


ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),  # GPT-2's "gelu_new"
    "relu": F.relu,
    "relu2": relu2,
}


class MLPConfig(ComponentConfig):
    hidden_dim: int = Field(0, ge=0, description="hidden width (0 = 4 * dim, as GPT-2)")
    activation: Literal["gelu", "gelu_tanh", "relu", "relu2"] = Field(
        "gelu", description='"gelu" (exact), "gelu_tanh" (GPT-2), "relu", "relu2" (squared '
        "ReLU, Primer)")
    bias: bool = Field(False, description="biases on both layers (GPT-2: true)")


@register("ffn", "mlp")
class MLP(nn.Module):
    """Two-layer MLP: w2(act(w1 x)), optional biases (GPT-2's feed-forward)."""

    Config = MLPConfig

    def __init__(self, cfg: MLPConfig, *, dim: int, layer_idx: int, n_layers: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_dim = cfg.hidden_dim or 4 * dim
        self.activation = cfg.activation
        self.act = ACTIVATIONS[cfg.activation]
        self.w1 = nn.Linear(dim, self.hidden_dim, bias=cfg.bias)  # up
        self.w2 = nn.Linear(self.hidden_dim, dim, bias=cfg.bias)  # down

    def init_weights(self, std: float, out_std: float) -> None:
        """w1 ~ N(0, std), the output projection w2 ~ N(0, out_std); biases at zero."""
        for lin, s in ((self.w1, std), (self.w2, out_std)):
            nn.init.trunc_normal_(lin.weight, mean=0.0, std=s)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim)
        return self.w2(self.act(self.w1(x)))

    def extra_repr(self) -> str:
        return f"hidden={self.hidden_dim}, activation={self.activation}"

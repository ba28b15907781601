"""LoRA: a low-rank update ``B @ A`` (scaled by ``alpha / rank``) added to chosen linear layers
of a frozen model (Hu et al., 2021), as ``peft``'s ``LoraLayer`` computes it.

Each target layer gets a child ``lora`` (parameters ``A`` (rank, in) and ``B`` (out, rank));
``on_linear.py`` adds it, freezes every base parameter (``requires_grad = False``, so the
optimizers never hold it), initialises ``A`` and ``B`` as peft does (``B`` at zero: training
starts from the base model exactly) and merges.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.components.adapters.on_linear import (
    DEFAULT_TARGETS,
    LinearAdapter,
    LowRankConfig,
    LowRankLayer,
)
from kiln.components.registry import register

__all__ = ["DEFAULT_TARGETS", "LoRA", "LoRAConfig", "LoRAPair", "is_adapter", "merge"]


class LoRAConfig(LowRankConfig):
    """Rank, scale, dropout and target layers of the low-rank adapters."""


class LoRAPair(LowRankLayer):
    """``A`` (rank, in) and ``B`` (out, rank): ``forward(x) = dropout(x) @ A.T @ B.T * scale``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__(base, rank, alpha, dropout)
        self.init_on_device(base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.dropout(x) @ self.A.t() @ self.B.t()) * self.scale

    def adapt(self, base: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        down = self.dropout(x) @ self.A.t()  # (..., rank)
        # One addmm: out + scale * down @ B.T without a separate product and sum over (N, out).
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), down.reshape(-1, down.shape[-1]),
                           self.B.t(), alpha=self.scale)
        return flat.view(out.shape)

    def extend_head(self, hidden: torch.Tensor, weight: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale * dropout(x) @ A.T, B)``, (..., rank) and (V, rank)."""
        return (self.dropout(hidden) @ self.A.t()) * self.scale, self.B

    def delta(self) -> torch.Tensor:
        """The update of the base weight: ``scale * B @ A`` (out, in)."""
        return (self.B @ self.A) * self.scale

    def merged_weight(self, base: nn.Linear) -> torch.Tensor:
        return base.weight + self.delta().to(base.weight.dtype)

    def peft_tensors(self) -> dict[str, tuple[torch.Tensor, bool]]:
        return {"lora_A.weight": (self.A, False), "lora_B.weight": (self.B, True)}


@register("adapter", "lora")
class LoRA(LinearAdapter):
    """Low-rank adapters on the target linear layers; everything else frozen."""

    Config = LoRAConfig
    child = "lora"

    def layer(self, base: nn.Linear) -> LoRAPair:
        c = self.cfg
        return LoRAPair(base, c.rank, c.alpha, c.dropout)


def is_adapter(name: str) -> bool:
    """A parameter or state-dict name of a LoRA adapter (``layers.0.attention.wq.lora.A``).
    Kept for plugins; kiln asks the adapter itself (``AdapterContract.owns``)."""
    return ".lora." in name


def merge(model: nn.Module) -> int:
    """Fold every LoRA adapter into its base weight and remove it. Kept for plugins; kiln calls
    the adapter's own ``merge`` (``AdapterContract``)."""
    return LoRA(LoRAConfig(type="lora")).merge(model)

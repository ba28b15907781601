"""DoRA: weight-decomposed low-rank adaptation (Liu et al., 2024), as ``peft`` computes it with
``use_dora = true``.

The adapted weight is ``W' = m * V / ||V||`` with ``V = W + scale * B @ A`` and the norm taken
per output row: a trainable magnitude ``m`` (out,) and the direction of the low-rank-updated
weight. The norm is treated as a constant in the backward pass (the paper's section 4.3, and
peft's), so ``A`` and ``B`` get their gradient through ``V`` alone. ``m`` starts at ``||W||``
and ``B`` at zero: training starts from the base model exactly. The layer's output is
``out + (m / ||V|| - 1) * x @ W.T + (m / ||V||) * scale * x @ A.T @ B.T`` (bias untouched),
with dropout on ``x`` for both added terms when it is on.

Each target layer gets a child ``dora`` (``A``, ``B``, ``magnitude``); ``on_linear.py`` does
the rest (targets, freezing, merging), and the ``peft`` export writes ``lora_A``, ``lora_B``
and ``lora_magnitude_vector`` with ``use_dora = true``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.components.adapters.on_linear import LinearAdapter, LowRankConfig, LowRankLayer
from kiln.components.registry import register


class DoRAConfig(LowRankConfig):
    """Rank, scale, dropout and target layers of the weight-decomposed adapters."""


class DoRALayer(LowRankLayer):
    """``A`` (rank, in), ``B`` (out, rank) and ``magnitude`` (out,) of one linear layer."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__(base, rank, alpha, dropout)
        self.magnitude = nn.Parameter(torch.ones(base.out_features, device=base.weight.device,
                                                 dtype=base.weight.dtype))
        self.init_on_device(base)

    def reset_adapter(self, base: nn.Linear) -> None:
        super().reset_adapter(base)
        self.on_base_loaded(base)

    @torch.no_grad()
    def on_base_loaded(self, base: nn.Linear) -> None:
        self.magnitude.copy_(self._norm(base.weight).to(self.magnitude.dtype))

    def _norm(self, weight: torch.Tensor) -> torch.Tensor:
        """``||W + scale * B @ A||`` per output row, detached (out,)."""
        delta = (self.B @ self.A).detach().to(weight.dtype)
        return torch.linalg.vector_norm(weight.detach() + self.scale * delta, dim=1)

    def _ratio(self, weight: torch.Tensor) -> torch.Tensor:
        """``m / ||V||`` (out,): gradient to ``m`` only."""
        return self.magnitude / self._norm(weight).to(self.magnitude.dtype)

    def _dropped(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        dropping = self.training and isinstance(self.dropout, nn.Dropout)
        return (self.dropout(x) if dropping else x), dropping

    def adapt(self, base: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        ratio = self._ratio(base.weight).to(out.dtype)
        xd, dropping = self._dropped(x)
        if dropping:  # the base term on the dropped input too, as peft computes it, in the
            # dtype of the layer's output (a router's logits are fp32 whatever its input's)
            plain = F.linear(xd.to(out.dtype), base.weight.to(out.dtype))
        else:
            plain = out if base.bias is None else out - base.bias
        update = (xd @ self.A.t() @ self.B.t()) * self.scale
        return out + (ratio - 1) * plain + ratio * update

    def extend_head(self, hidden: torch.Tensor, weight: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[x, scale * x @ A.T]`` against ``[(r - 1) * W, r * B]`` (r = m / ||V|| per row)."""
        ratio = self._ratio(weight).to(weight.dtype)[:, None]
        xd, _ = self._dropped(hidden)
        extra_h = torch.cat([xd, (xd @ self.A.t()) * self.scale], dim=-1)
        extra_w = torch.cat([(ratio - 1) * weight.detach(), ratio * self.B.to(weight.dtype)],
                            dim=1)
        return extra_h, extra_w

    def merged_weight(self, base: nn.Linear) -> torch.Tensor:
        v = base.weight + self.scale * (self.B @ self.A).to(base.weight.dtype)
        return self._ratio(base.weight).to(v.dtype)[:, None] * v

    def peft_tensors(self) -> dict[str, tuple[torch.Tensor, bool]]:
        return {"lora_A.weight": (self.A, False), "lora_B.weight": (self.B, True),
                "lora_magnitude_vector": (self.magnitude, True)}


@register("adapter", "dora")
class DoRA(LinearAdapter):
    """Weight-decomposed low-rank adapters on the target linear layers; everything else
    frozen."""

    Config = DoRAConfig
    child = "dora"

    def layer(self, base: nn.Linear) -> DoRALayer:
        c = self.cfg
        return DoRALayer(base, c.rank, c.alpha, c.dropout)

    def peft_config(self) -> dict[str, Any]:
        return {**super().peft_config(), "use_dora": True}

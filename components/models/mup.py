"""µP (Tensor Programs V, Yang et al. 2022) for the transformer family: hyperparameters tuned at
``base_dim`` transfer to other widths.

With width multiplier m = dim / base_dim, kiln follows the paper's Table 3 in the "readout
multiplier" form of its ``mup`` package (MuReadout), which equals the standard parametrization
at m = 1:

- hidden matrices (every block weight with two or more dimensions: attention and FFN
  projections, MoE expert stacks): init std / sqrt(m) (variance 1 / fan_in), and an AdamW-family
  LR of lr / m (``lr_multipliers``; routing puts them in their own param group);
- the MoE router (fan-in grows, fan-out is the fixed expert count: an output-like matrix without
  a multiplier, Table 3's "output weights"): init std / m and LR lr / m;
- embeddings, norms, biases and other vectors: unchanged (init and LR);
- the output layer: its logits are multiplied by 1 / m (tied or not; applied to the final
  hidden state, so the chunked loss, tensor and pipeline parallelism see the same logits);
- attention: scores scale as sqrt(base_head_dim) / head_dim (the paper's 1/d attention, equal
  to 1/sqrt(head_dim) at the base head width); ``base_head_dim = 0`` takes the head width
  itself, right when heads keep their width as the model widens (kiln ladder's rule).

Muon needs no LR factor: its orthogonalised update with ``lr_scaling = "spectral"`` has spectral
norm sqrt(fan_out / fan_in), the condition for width-independent feature learning (Yang, Simon
& Bernstein 2023, "A spectral condition for feature learning"); the optimizers say which rule
they follow (``OptimizerConfig.mup_rule``). Depth transfer (depth-µP) is not implemented: ladders
that grow depth keep the standard residual scaling.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kiln.components.adapter_contract import AdapterLayer
from kiln.components.errors import RecipeError


def width_mult(cfg) -> float:
    return cfg.dim / cfg.base_dim if cfg.parametrization == "mup" else 1.0


def set_attention_scale(blocks: list[nn.Module], base_head_dim: int) -> None:
    """Give every block's attention its µP query factor sqrt(base_head_dim / head_dim)."""
    if not base_head_dim:
        return
    for block in blocks:
        attn = block.attention
        if not hasattr(type(attn), "q_scale"):
            raise RecipeError(f"model.base_head_dim: attention type {type(attn).__name__} has no "
                              "q_scale (µP's attention scale); leave base_head_dim = 0")
        attn.q_scale = math.sqrt(base_head_dim / attn.head_dim)


@torch.no_grad()
def rescale_routers(blocks: list[nn.Module], m: float) -> None:
    """MoE routers from init std / sqrt(m) (what hidden matrices get) to std / m."""
    for block in blocks:
        router = getattr(block.feed_forward, "router", None)
        if router is not None:
            router.weight.mul_(m**-0.5)


def hidden_multipliers(model: nn.Module, m: float) -> dict[str, float]:
    """Parameter name -> 1 / m for the hidden matrices and routers (names as the model that
    the optimizers see reports them: wrapped blocks keep their wrappers' prefixes). Adapter
    matrices (LoRA, DoRA) keep the optimizer's LR: their rank does not grow with width."""
    adapters = {f"{name}.{key}" for name, module in model.named_modules()
                if isinstance(module, AdapterLayer)
                for key, _ in module.named_parameters()}
    return {name: 1.0 / m for name, p in model.named_parameters()
            if name.startswith(("layers.", "mtp.")) and p.ndim >= 2 and name not in adapters}

"""Routing health of a model's MoE layers: per-expert load, dead experts, the balancing bias and
its drift, and the router's per-token entropy.

Built on what ``moe.MoE`` already keeps: ``last_load`` (the last successful global step's
tokens per expert, summed over every rank) and ``expert_bias``. ``update()`` runs after every
global step on the device (no host sync): an expert whose load stays below ``dead_below`` times
the mean load counts one more step, any other resets to 0. ``snapshot()`` brings everything to
the host once, at the log interval.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kiln.components.ffn.moe import MoE


@dataclass
class RoutingSnapshot:
    step: int
    load: list[list[float]]  # (L, E) fraction of the step's token assignments per expert
    bias: list[list[float]]  # (L, E) balancing bias
    dead_steps: list[list[int]]  # (L, E) consecutive steps below the threshold
    bias_drift: list[float]  # (L,) RMS change of the bias since the previous snapshot
    layer_ids: list[int]


class RoutingHealth:
    def __init__(self, layers: list[MoE], dead_below: float) -> None:
        self.layers = layers
        self.dead_below = dead_below
        e = max(layer.n_experts for layer in layers)
        dev = layers[0].expert_bias.device
        self.dead = torch.zeros(len(layers), e, dtype=torch.int64, device=dev)  # (L, E)
        self.width = [layer.n_experts for layer in layers]
        self._last_bias = self._bias().clone()

    def _stack(self, name: str) -> torch.Tensor:
        """One (L, E) fp32 tensor of a per-expert buffer, padded where layers have fewer."""
        rows = [getattr(layer, name).float() for layer in self.layers]
        out = torch.zeros(len(rows), self.dead.shape[1], device=self.dead.device)
        for i, row in enumerate(rows):
            out[i, : row.numel()] = row.to(out.device)
        return out

    def _bias(self) -> torch.Tensor:
        return self._stack("expert_bias")

    @torch.no_grad()
    def update(self) -> None:
        """After a global step that updated the loads (not a skipped one)."""
        load = self._stack("last_load")  # (L, E)
        width = torch.tensor(self.width, device=load.device, dtype=torch.float32)[:, None]
        mean = load.sum(-1, keepdim=True).clamp_min(1) / width  # (L, 1)
        valid = torch.arange(load.shape[1], device=load.device)[None, :] < width
        low = (load < self.dead_below * mean) & valid
        self.dead = torch.where(low, self.dead + 1, torch.zeros_like(self.dead))

    @torch.no_grad()
    def snapshot(self, step: int) -> RoutingSnapshot:
        load = self._stack("last_load")
        bias = self._bias()
        drift = ((bias - self._last_bias) ** 2).sum(-1) / torch.tensor(
            self.width, dtype=torch.float32, device=bias.device)
        self._last_bias = bias.clone()
        frac = load / load.sum(-1, keepdim=True).clamp_min(1)
        frac, bias, dead, drift = (t.cpu() for t in (frac, bias, self.dead, drift.sqrt()))
        cut = lambda t: [row[:w].tolist() for row, w in zip(t, self.width, strict=True)]  # noqa: E731
        return RoutingSnapshot(step, cut(frac), cut(bias), cut(dead), drift.tolist(),
                               [layer.layer_idx for layer in self.layers])


@torch.no_grad()
def router_entropy(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """fp32 [summed normalised entropy of the router's per-token distribution, tokens] for the
    MoE input ``x`` (..., D): 1 = the router cannot tell experts apart, 0 = one expert takes
    all. Scores are normalised to sum to 1 (sigmoid scores too)."""
    flat = x.reshape(-1, x.shape[-1])
    _, _, scores = layer.route(flat)  # (N, E)
    p = scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1) / math.log(max(layer.n_experts, 2))
    return torch.stack([ent.sum(), torch.tensor(float(flat.shape[0]), device=ent.device)])

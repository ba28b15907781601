"""Model-level mixture-of-experts protocol: after a global step the expert biases move on the
loads of every rank (``moe.balance_step``), the sequence-wise auxiliary loss is collected
(``pop_aux_loss``), per-layer load metrics (``moe_metrics``), and the mixin that gives a model
all three (``MoEModelMixin``). The layer itself is ``moe.MoE``."""

from __future__ import annotations

import math

import torch

from kiln.components.ffn.moe import MoE, balance_step, moe_layers
from kiln.components.ffn.moe_dispatch import expert_widths, resolve_kernel


def pop_aux_loss(layers: list[MoE]) -> torch.Tensor | None:
    """The summed auxiliary loss of the last forward(s), cleared so no graph is kept."""
    total = None
    for layer in layers:
        if layer.aux_loss is not None:
            total = layer.aux_loss if total is None else total + layer.aux_loss
            layer.aux_loss = None
    return total


def moe_metrics(layers: list[MoE], prefix: str = "moe") -> dict[str, float]:
    """Per layer: max/min load as a multiple of the mean, normalised entropy, dropped share;
    from the last successful step's global loads (one host transfer for all layers)."""
    if not layers:
        return {}
    loads = torch.stack([layer.last_load for layer in layers]).double()  # (L, E)
    dropped = torch.stack([layer.last_dropped for layer in layers]).double()  # (L,)
    total = loads.sum(-1).clamp_min(1)  # (L,)
    rel = loads / (total[:, None] / loads.shape[-1])  # (L, E), 1 = perfectly balanced
    p = loads / total[:, None]
    ent = -(p * p.clamp_min(1e-30).log()).sum(-1) / math.log(max(loads.shape[-1], 2))
    table = torch.stack([rel.max(-1).values, rel.min(-1).values, ent, dropped / total]).cpu()
    out = {}
    for i, layer in enumerate(layers):
        name = f"{prefix}/layer{layer.layer_idx}"
        out[f"{name}/max_load"] = float(table[0, i])
        out[f"{name}/min_load"] = float(table[1, i])
        out[f"{name}/entropy"] = float(table[2, i])
        if layer.cfg.capacity_factor:
            out[f"{name}/dropped"] = float(table[3, i])
    out[f"{prefix}/max_load"] = float(table[0].max())
    out[f"{prefix}/min_load"] = float(table[1].min())
    return out


class MoEModelMixin:
    """Model-level MoE protocol for any model whose blocks may hold ``MoE`` layers:
    ``on_global_step``, ``pop_aux_loss``, ``metrics`` and ``resolve_kernels``. The layer list
    is cached (the parallelism code wraps blocks, it does not add or remove MoE layers)."""

    def _moe_layers(self) -> list[MoE]:
        cached = self.__dict__.get("_moe_cache")
        if cached is None:
            cached = moe_layers(self)
            self.__dict__["_moe_cache"] = cached
        return cached

    def on_global_step(self, skipped: bool) -> None:
        """Once per global step (after all its segments): move the expert biases."""
        balance_step(self._moe_layers(), skipped, group=getattr(self, "balance_group", None))

    def pop_aux_loss(self) -> torch.Tensor | None:
        return pop_aux_loss(self._moe_layers())

    def metrics(self) -> dict[str, float]:
        return moe_metrics(self._moe_layers())

    def resolve_kernels(self, device: torch.device, dtype: torch.dtype,
                        compiling: bool = False) -> str:
        """Decide the expert kernel of every MoE layer for ``device``/``dtype`` (and
        ``torch.compile`` or not) now, before any forward; one line saying which is used ("" without
        MoE layers)."""
        kernels = sorted({resolve_kernel(m.cfg.dispatch, device, dtype, expert_widths(m),
                                         compiling)
                          for m in self._moe_layers()})
        if not kernels:
            return ""
        names = {"grouped": "grouped (torch._grouped_mm)", "loop": "loop (one matmul per expert)"}
        dispatch = sorted({m.cfg.dispatch for m in self._moe_layers()})
        return (f"MoE expert kernel {' + '.join(names[k] for k in kernels)} on {device.type} "
                f"{str(dtype).removeprefix('torch.')}{' compiled' if compiling else ''} "
                f"(dispatch = {', '.join(dispatch)})")

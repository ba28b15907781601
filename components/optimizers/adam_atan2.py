"""AdamATan2 (Everett et al. 2024) in the HRM / ``adam-atan2`` kernel form, with optional EMA.

Adam's ``m / (sqrt(v) + eps)`` becomes ``atan2(m, sqrt(v))``: bounded, scale-invariant and
free of epsilon. Per step, with bias corrections ``bc1 = 1 - b1**t`` and ``bc2 = 1 - b2**t``::

    p *= 1 - lr * wd;  m = lerp(m, g, 1 - b1);  v = lerp(v, g*g, 1 - b2)
    p -= (lr / bc1) * atan2(m, sqrt(v) / sqrt(bc2))

The PyPI ``adam-atan2`` package is a CUDA-only extension, hence this foreach version. With
``ema > 0`` an exponential moving average of the weights is kept in the optimizer state (so it
checkpoints through DCP with the rest of the state); ``swap_ema()`` exchanges weights and EMA in
place, e.g. to evaluate or export the EMA weights, and again to swap back.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kiln.components.distributed import local_tensor
from kiln.components.optimizers.common import AdamFamilyConfig
from kiln.components.registry import register


class AdamATan2Config(AdamFamilyConfig):
    ema: float = Field(
        0.0, ge=0, lt=1, description="decay of an EMA of the weights kept in the state (0 = off)"
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    # Every operation here is elementwise, so FSDP2 shards are updated through their local views.
    return local_tensor(t)


class AdamATan2(torch.optim.Optimizer):
    """AdamATan2 with decoupled weight decay; state: step, exp_avg, exp_avg_sq (+ ema)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.95), weight_decay: float = 0.0,
                 ema: float = 0.0):
        if not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1:
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                                      ema=ema))
        self.ema_swapped = False  # True while the EMA weights are in the model

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.ema_swapped:
            if any("ema" in s for s in self.state.values()):
                raise RuntimeError("AdamATan2.step() while the EMA weights are swapped in; call "
                                   "swap_ema() again first")
            # The state was cleared after the swap (weights-only resume from EMA weights): the
            # EMA weights are now simply the weights a new run starts from.
            self.ema_swapped = False
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            b1, b2 = group["betas"]
            for p in params:
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                if group["ema"] > 0 and "ema" not in state:
                    state["ema"] = p.detach().clone()
            states = [self.state[p] for p in params]
            # Parameters of one group share the step count unless one missed gradients: bucket
            # by step so bias corrections stay exact without a per-tensor loop.
            by_step: dict[float, list[int]] = {}
            for i, s in enumerate(states):
                s["step"] += 1
                by_step.setdefault(float(s["step"]), []).append(i)
            lr, wd = float(group["lr"]), group["weight_decay"]
            for t, ids in by_step.items():
                ps = [_local(params[i]) for i in ids]
                gs = [_local(params[i].grad) for i in ids]
                ms = [_local(states[i]["exp_avg"]) for i in ids]
                vs = [_local(states[i]["exp_avg_sq"]) for i in ids]
                bc1, bc2 = 1 - b1**t, 1 - b2**t
                if wd:
                    torch._foreach_mul_(ps, 1 - lr * wd)
                torch._foreach_lerp_(ms, gs, 1 - b1)
                torch._foreach_lerp_(vs, torch._foreach_mul(gs, gs), 1 - b2)
                denom = torch._foreach_sqrt(vs)
                torch._foreach_div_(denom, bc2**0.5)
                # No foreach atan2 in torch: one kernel per tensor.
                steps = [torch.atan2(m, d) for m, d in zip(ms, denom, strict=True)]
                torch._foreach_add_(ps, steps, alpha=-lr / bc1)
                if group["ema"] > 0:
                    es = [_local(states[i]["ema"]) for i in ids]
                    torch._foreach_lerp_(es, ps, 1 - group["ema"])
        return loss

    @torch.no_grad()
    def swap_ema(self) -> bool:
        """Exchange the weights with their EMA (in place); returns whether EMA is now in use."""
        pairs = [(_local(p), _local(self.state[p]["ema"])) for g in self.param_groups
                 for p in g["params"] if "ema" in self.state.get(p, {})]
        if not pairs:
            raise RuntimeError("swap_ema(): no EMA weights (set ema > 0 and take a step first)")
        for w, e in pairs:
            tmp = w.clone()
            w.copy_(e)
            e.copy_(tmp)
        self.ema_swapped = not self.ema_swapped
        return self.ema_swapped


@register("optimizer", "adam_atan2", config=AdamATan2Config)
def build_adam_atan2(cfg: AdamATan2Config, groups: list[dict]) -> torch.optim.Optimizer:
    """AdamATan2: Adam with atan2(m, sqrt(v)) in place of m / (sqrt(v) + eps); optional EMA."""
    return AdamATan2(groups, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]),
                     weight_decay=cfg.weight_decay, ema=cfg.ema)

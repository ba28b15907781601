"""SGD and sign-SGD, for small groups of scalars (gates, loop coefficients) that want plain,
pack-invariant steps rather than Adam's per-element normalisation.

``sgd`` is torch.optim.SGD (weight decay is L2: added to the gradient, as torch does).
``sign_sgd`` steps by ``lr * sign(g)`` (or of the momentum with ``momentum > 0``: signum), with
decoupled weight decay ``p *= 1 - lr * wd`` — the same update as signing the gradient and then
calling torch's SGD, which is what the looped-MoE reference does.
"""

from __future__ import annotations

import torch
from pydantic import Field

from kiln.components.distributed import local_tensor
from kiln.components.errors import RecipeError
from kiln.components.optimizers.common import OptimizerConfig
from kiln.components.registry import register


class SGDConfig(OptimizerConfig):
    momentum: float = Field(0.0, ge=0, lt=1, description="momentum factor (0 = plain SGD)")
    nesterov: bool = Field(False, description="Nesterov momentum (needs momentum > 0)")
    dampening: float = Field(0.0, ge=0, le=1, description="dampening of the momentum")


class SignSGDConfig(OptimizerConfig):
    momentum: float = Field(
        0.0, ge=0, lt=1, description="EMA of gradients whose sign is taken (0 = sign of g)"
    )


@register("optimizer", "sgd", config=SGDConfig)
def build_sgd(cfg: SGDConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """Stochastic gradient descent (torch.optim.SGD), optionally with momentum."""
    if cfg.nesterov and cfg.momentum == 0:
        raise RecipeError("sgd: nesterov = true needs momentum > 0; set momentum or drop nesterov")
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                           nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


class SignSGD(torch.optim.Optimizer):
    """p -= lr * sign(g) (or sign of the momentum EMA), with decoupled weight decay."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            lr, wd, mu = float(group["lr"]), group["weight_decay"], group["momentum"]
            ps, gs = [_local(p) for p in params], [_local(p.grad) for p in params]
            if mu > 0:
                bufs = []
                for p in params:
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                    bufs.append(_local(self.state[p]["momentum_buffer"]))
                torch._foreach_lerp_(bufs, gs, 1 - mu)
                gs = bufs
            if wd:
                torch._foreach_mul_(ps, 1 - lr * wd)
            torch._foreach_add_(ps, torch._foreach_sign(gs), alpha=-lr)
        return loss


@register("optimizer", "sign_sgd", config=SignSGDConfig)
def build_sign_sgd(cfg: SignSGDConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """Sign-SGD / signum: every element moves by exactly lr per step."""
    return SignSGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)

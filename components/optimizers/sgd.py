"""SGD and sign-SGD, for small groups of scalars (gates, loop coefficients) that want plain,
pack-invariant steps rather than Adam's per-element normalisation.

``sgd`` is torch.optim.SGD (weight decay is L2: added to the gradient, as torch does).
``sign_sgd`` steps by ``lr * sign(g)`` (or of the momentum with ``momentum > 0``: signum), with
decoupled weight decay ``p *= 1 - lr * wd`` — the same update as signing the gradient and then
calling torch's SGD, which is what the looped-MoE reference does.

A parameter that only parameterises another value (the learned loop scale ``lambda =
lambda_max * sigmoid(raw)``) is stepped in the value's space with ``value_space = true``: the
model names such parameters with ``value_jacobians()`` (parameter -> d value / d parameter,
elementwise), and the step becomes ``lr * sign(g) / jacobian`` (Jacobian clamped at 1e-4), so the
value itself moves by ``lr`` to first order, as the reference's lambda optimizer does (it sets
the raw gradient to ``sign(g) / jac`` before SGD). Without it the raw parameter moves by ``lr``
and lambda by only ``jac * lr`` (0.25 lr at lambda = lambda_max / 2).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
from pydantic import Field, model_validator

from kiln.components.distributed import local_tensor
from kiln.components.optimizers.common import OptimizerConfig
from kiln.components.registry import register


class SGDConfig(OptimizerConfig):
    mup_rule: ClassVar[str] = "refuse"  # µP's SGD rules (input and output LRs) are not here
    momentum: float = Field(0.0, ge=0, lt=1, description="momentum factor (0 = plain SGD)")
    nesterov: bool = Field(
        False, description="Nesterov momentum (needs momentum > 0 and dampening = 0)"
    )
    dampening: float = Field(0.0, ge=0, le=1, description="dampening of the momentum")

    @model_validator(mode="after")
    def _nesterov(self) -> SGDConfig:
        # torch.optim.SGD refuses these with a bare ValueError when it is built
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise ValueError(
                f"nesterov = true needs momentum > 0 and dampening = 0 (momentum = "
                f"{self.momentum}, dampening = {self.dampening}); set them or drop nesterov"
            )
        return self


class SignSGDConfig(OptimizerConfig):
    momentum: float = Field(
        0.0, ge=0, lt=1, description="EMA of gradients whose sign is taken (0 = sign of g)"
    )
    value_space: bool = Field(
        True, description="for a parameter that parameterises a value (the model's "
        "value_jacobians(), e.g. the learned loop scale), move the value by lr rather than the "
        "raw parameter (divide the step by the Jacobian, as the looped-MoE reference)"
    )


@register("optimizer", "sgd", config=SGDConfig)
def build_sgd(cfg: SGDConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """Stochastic gradient descent (torch.optim.SGD), optionally with momentum."""
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, dampening=cfg.dampening,
                           nesterov=cfg.nesterov, weight_decay=cfg.weight_decay)


def _local(t: torch.Tensor) -> torch.Tensor:
    return local_tensor(t)


JAC_FLOOR = 1e-4  # the reference's clamp: a saturated parameterisation still moves


class SignSGD(torch.optim.Optimizer):
    """p -= lr * sign(g) (or sign of the momentum EMA), with decoupled weight decay; divided by
    d value / d p for the parameters given to ``set_value_jacobians``."""

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0,
                 value_space: bool = False):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        self.value_space = value_space
        self.jacobians: dict[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]] = {}

    def set_value_jacobians(
        self, jacobians: dict[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]
    ) -> None:
        """The model's ``value_jacobians()``; used for the parameters this optimizer trains when
        ``value_space`` is on (a no-op otherwise)."""
        mine = {p for g in self.param_groups for p in g["params"]}
        self.jacobians = {p: fn for p, fn in jacobians.items() if p in mine} \
            if self.value_space else {}

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
            steps = list(torch._foreach_sign(gs))
            for i, p in enumerate(params):
                jac = self.jacobians.get(p)
                if jac is not None:  # sign(g) / (d value / d p): the value moves by lr
                    steps[i] = steps[i] / jac(ps[i]).clamp_min(JAC_FLOOR)
            torch._foreach_add_(ps, steps, alpha=-lr)
        return loss


@register("optimizer", "sign_sgd", config=SignSGDConfig)
def build_sign_sgd(cfg: SignSGDConfig, groups: list[dict]) -> torch.optim.Optimizer:
    """Sign-SGD / signum: every element moves by exactly lr per step."""
    return SignSGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay,
                   value_space=cfg.value_space)

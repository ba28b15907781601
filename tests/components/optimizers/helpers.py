"""Shared by the optimizer tests: a tiny model, a training step and a DCP round trip."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from kiln.checkpointing.storage import quiet_dcp


class Net(nn.Module):
    """Matrices of two shapes (a same-shape pair), a tall one, a norm and a bias."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 24, bias=False)
        self.b = nn.Linear(24, 24, bias=True)
        self.c = nn.Linear(24, 24, bias=False)
        self.d = nn.Linear(24, 8, bias=False)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.d(self.c(torch.tanh(self.b(self.a(x))))))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def train_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 16, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def dcp_round_trip(
    make_opt: Callable[[nn.Module], torch.optim.Optimizer], tmp_path: Path,
    make_model: Callable[[], nn.Module] = make_net, steps: int = 3,
) -> float:
    """Train, save model + optimizer with DCP, load into fresh copies, take one more step on
    both; returns the largest parameter difference afterwards (0 for an exact round trip)."""
    model = make_model()
    opt = make_opt(model)
    train_steps(model, opt, steps)
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    quiet_dcp()  # one process, on purpose
    dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)

    model2 = make_model()
    opt2 = make_opt(model2)
    train_steps(model2, opt2, 1, seed=99)  # materialise state so loading must overwrite it
    state2 = {"model": model2.state_dict(), "optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(state2, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    model2.load_state_dict(state2["model"])
    set_optimizer_state_dict(model2, opt2, state2["optim"])

    train_steps(model, opt, 1, seed=7)
    train_steps(model2, opt2, 1, seed=7)
    return max((p - q).abs().max().item()
               for p, q in zip(model.parameters(), model2.parameters(), strict=True))

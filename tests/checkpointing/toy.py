"""A small stand-in for the trainer's state: a model with an optional carry, AdamW, a progress
counter, a cursor-style loader and a JSON-state guard. Enough for the manager's contract."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from kiln.components.distributed import World
from kiln.recipes.training.trainer import Progress  # the real one: checkpoints store its state


class ToyModel(nn.Module):
    def __init__(self, dim: int = 8, carry: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, 16)
        self.out = nn.Linear(16, dim)
        self.carry = torch.zeros(2, dim) if carry else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))

    def carry_state(self) -> dict[str, torch.Tensor] | None:
        return None if self.carry is None else {"z": self.carry}

    def load_carry_state(self, d: dict[str, torch.Tensor]) -> None:
        self.carry = d["z"].clone()


class ToyLoader:
    """Batches are a pure function of a cursor, like the packed-document loader."""

    def __init__(self, dim: int = 8, seed: int = 0) -> None:
        self.dim, self.seed, self.cursor = dim, seed, 0

    def next(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.cursor)
        self.cursor += 1
        return torch.randn(4, self.dim, generator=g)

    def state_dict(self) -> dict:
        return {"cursor": self.cursor}

    def load_state_dict(self, d: dict) -> None:
        self.cursor = int(d["cursor"])

    def skip_steps(self, n: int) -> None:
        self.cursor += n


class ToyGuard:
    def __init__(self) -> None:
        self.ema: float | None = None
        self.skips = 0
        self.aborted = False

    def state_dict(self) -> dict:
        return {"ema": self.ema, "skips": self.skips, "aborted": self.aborted}

    def load_state_dict(self, d: dict) -> None:
        self.ema, self.skips, self.aborted = d["ema"], d["skips"], d["aborted"]


@dataclass
class ToyState:
    model: nn.Module
    optimizers: dict
    progress: Progress = field(default_factory=Progress)
    train_loader: ToyLoader = field(default_factory=ToyLoader)
    guards: dict = field(default_factory=lambda: {"spike": ToyGuard()})
    world: World = field(default_factory=lambda: World(0, 1, 0, torch.device("cpu")))
    recipe_toml: str | None = None

    def train_step(self) -> float:
        """One step whose loss depends on weights, optimizer moments, data and every RNG."""
        x = self.train_loader.next()
        noise = torch.randn(()) * 1e-3 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        loss = ((self.model(x) - x) ** 2).mean() + noise
        for opt in self.optimizers.values():
            opt.zero_grad()
        loss.backward()
        for opt in self.optimizers.values():
            opt.step()
        if getattr(self.model, "carry", None) is not None:
            self.model.carry = self.model.carry + x[:2].detach()
        guard = self.guards.get("spike")
        if guard is not None:
            value = loss.item()
            guard.ema = value if guard.ema is None else 0.9 * guard.ema + 0.1 * value
        self.progress.step += 1
        self.progress.tokens += 32
        return loss.item()


def toy_state(seed: int = 0, carry: bool = False, two_optimizers: bool = False) -> ToyState:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = ToyModel(carry=carry)
    if two_optimizers:
        opts = {"a": torch.optim.AdamW(model.inp.parameters(), lr=1e-2),
                "b": torch.optim.SGD(model.out.parameters(), lr=1e-2, momentum=0.9)}
    else:
        opts = {"main": torch.optim.AdamW(model.parameters(), lr=1e-2)}
    return ToyState(model=model, optimizers=opts)

"""Elastic resume runs shared by the in-process (1 rank) and the spawned (2 gloo ranks) halves of
``test_elastic_resume``: the three recipe families at tiny sizes, N steps, stopped after k.

Everything here runs with torch.compile off (``eager``): what is under test is where state goes
on another layout, and the compiled step of torchao's 8-bit AdamW (one compile per parameter
shape and process) was most of this test's time. tests/components/optimizers/test_adamw8bit.py
tests that step compiled."""

from __future__ import annotations

import io
import json
from pathlib import Path
from unittest import mock

import torch

from kiln.components.protocols import Hook
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.conftest import CONFIGS

N, K = 6, 3  # steps in all; the cut runs save at K and stop
COMMON = ["--training.seq_len=32", "--training.global_batch=4", "--training.micro_batch=2",
          "--data.max_bytes=300000", "--data.eval_fraction=0.2", "--run.log_interval=1",
          "--run.progress_bar=false", "--run.tensorboard=false", "--eval.interval=0",
          "--eval.at_end=false", f"--checkpoint.interval={K}", f"--training.steps={N}",
          "--training.threads=1"]
RECIPES = {
    "dense": ("debug.toml", ["--model.dim=32", "--model.n_layers=2",
                             "--model.attention.n_heads=2", "--model.ffn.hidden_dim=64",
                             "--optimizer.lr=3e-3"]),
    # segmented BPTT (K = 2 of H = 4 loops), carry on, MoE bias balancing, spike guard
    "looped": ("looped_moe_debug.toml", ["--model.dim=32", "--model.attention.n_heads=2",
                                         "--model.ffn.hidden_dim=32", "--model.ffn.n_experts=4",
                                         "--guards.spike.warmup_steps=0", "--model.carry=true"]),
    # Muon + 8-bit AdamW (the (258, 32) embedding's moments are 8-bit)
    "nova": ("nova_debug.toml", ["--model.dim=32", "--model.n_layers=2",
                                 "--model.attention.n_heads=2", "--model.attention.n_kv_heads=1",
                                 "--model.ffn.hidden_dim=64",
                                 "--optimizers.muon.schedule.warmup_steps=2",
                                 "--optimizers.adamw.schedule.warmup_steps=2"]),
}


def eager():
    """``torch.compile(fn, ...)`` returns ``fn`` for the block: torchao's 8-bit AdamW calls it
    on its update at every step (``torch._dynamo.config.disable`` would make that call fail:
    a fullgraph compile that compiles nothing is an error)."""
    return mock.patch.object(torch, "compile", lambda fn, **_: fn)


class StopAfter(Hook):
    """Stops the loop after step ``k`` (after the checkpoint hook saved it)."""

    def __init__(self, k: int | None) -> None:
        self.k = k

    def on_step_end(self, trainer, result):
        if trainer.progress.step == self.k:
            trainer.stop_requested = True


def train(family: str, folder: Path, *extra: str, stop_after: int | None = None) -> str:
    """Train (or resume, when ``folder`` holds checkpoints); returns rank 0's console text."""
    name, tiny = RECIPES[family]
    recipe = load_recipe(CONFIGS / name, [*COMMON, *tiny, f"--run.folder={folder}", *extra])
    out = io.StringIO()
    Trainer(recipe, hooks=[StopAfter(stop_after)], out=out).fit()
    return out.getvalue()


def losses(folder: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}

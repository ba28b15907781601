"""Tiny trainer runs of a step on the debug recipe, with each step's loss and metrics recorded
(the preference and GRPO step tests)."""

from __future__ import annotations

import io

from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.conftest import CONFIGS


class Record:
    def __init__(self):
        self.loss: dict[int, float] = {}
        self.metrics: dict[int, dict[str, float]] = {}

    def on_step_end(self, trainer, result):
        self.loss[trainer.progress.step] = result.loss
        self.metrics[trainer.progress.step] = result.metrics


def recipe(base: tuple[str, ...], folder, *extra, steps: int):
    return load_recipe(CONFIGS / "debug.toml", [*base, f"--training.steps={steps}",
                                                f"--run.folder={folder}", *extra])


def run(base: tuple[str, ...], folder, *extra, steps: int):
    """(the record, the trainer, its log) of a whole run."""
    record, out = Record(), io.StringIO()
    trainer = Trainer(recipe(base, folder, *extra, steps=steps), hooks=[record], out=out)
    trainer.fit()
    return record, trainer, out.getvalue()

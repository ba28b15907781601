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
        self.flop_tokens: dict[int, float | None] = {}

    def on_step_end(self, trainer, result):
        self.loss[trainer.progress.step] = result.loss
        self.metrics[trainer.progress.step] = result.metrics
        self.flop_tokens[trainer.progress.step] = result.flop_tokens


def recipe(base: tuple[str, ...], folder, *extra, steps: int):
    return load_recipe(CONFIGS / "debug.toml", [*base, f"--training.steps={steps}",
                                                f"--run.folder={folder}", *extra])


def run(base: tuple[str, ...], folder, *extra, steps: int):
    """(the record, the trainer, its log) of a whole run."""
    record, out = Record(), io.StringIO()
    trainer = Trainer(recipe(base, folder, *extra, steps=steps), hooks=[record], out=out)
    trainer.fit()
    return record, trainer, out.getvalue()


def shared_and_whole(base: tuple[str, ...], tmp_path, monkeypatch, *extra, steps: int = 2):
    """Two runs, each pair's / group's prompt computed once (``share_prompts``, the default)
    and every row whole: (the shared run's record, its log, the layouts ``plan`` made, the
    whole run's record)."""
    from kiln.components.attention import shared_prefix

    layouts = []
    plan = shared_prefix.plan

    def spy(*args):
        layouts.append(plan(*args))
        return layouts[-1]

    with monkeypatch.context() as patch:
        patch.setattr(shared_prefix, "plan", spy)
        shared, _, log = run(base, tmp_path / "shared", *extra, steps=steps)
    whole, *_ = run(base, tmp_path / "whole", *extra, "--training.step.share_prompts=false",
                    steps=steps)
    return shared, log, layouts, whole

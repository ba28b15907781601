"""The progress bar shows on a terminal only; in a log file the log lines are the progress."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import torch

from kiln.components.protocols import complete_model
from kiln.recipes.hooks.log import LogHook
from kiln.recipes.hooks.progress import ProgressHook


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _trainer(out) -> SimpleNamespace:
    return SimpleNamespace(world=SimpleNamespace(is_main=True), out=out, total_steps=3,
                           recipe=SimpleNamespace(run=SimpleNamespace(progress_bar=True)),
                           progress=SimpleNamespace(step=0))


def test_no_bar_when_output_goes_to_a_file_or_pipe(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    hook = ProgressHook()
    hook.on_train_start(_trainer(io.StringIO()))
    assert hook.bar is None
    monkeypatch.setattr(sys, "stderr", _Terminal())  # stderr a terminal, stdout a file
    hook.on_train_start(_trainer(io.StringIO()))
    assert hook.bar is None


def test_bar_on_a_terminal(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    hook = ProgressHook()
    hook.on_train_start(_trainer(_Terminal()))
    assert hook.bar is not None
    hook.on_step_end(_trainer(_Terminal()), SimpleNamespace(loss=1.0))
    hook.close(None)
    assert "\r" in terminal.getvalue() and "1/3" in terminal.getvalue()


class _Metrics:
    def __init__(self):
        self.steps: list[int] = []

    def log(self, step, values) -> None:
        self.steps.append(step)


def _logging_trainer(out, *, total: int, interval: int) -> SimpleNamespace:
    return SimpleNamespace(
        world=SimpleNamespace(is_main=True, world_size=1), out=out, total_steps=total,
        recipe=SimpleNamespace(run=SimpleNamespace(log_interval=interval)),
        progress=SimpleNamespace(step=0, tokens=0), peak_flops=0, metrics=_Metrics(),
        optimizers=SimpleNamespace(lrs=dict), model=complete_model(torch.nn.Linear(1, 1)),
        guards={},
        device=torch.device("cpu"), print=lambda text: out.write(text + "\n"))


def test_step_one_and_the_last_step_are_always_logged():
    out = io.StringIO()
    trainer = _logging_trainer(out, total=60, interval=25)
    hook = LogHook()
    hook.on_train_start(trainer)
    for step in range(1, 61):
        trainer.progress.step, trainer.progress.tokens = step, step * 2048
        hook.on_step_end(trainer, SimpleNamespace(loss=5.0, grad_norm=None, metrics={},
                                                  skipped=False, tokens=2048,
                                                  flop_tokens=None))
    assert trainer.metrics.steps == [1, 25, 50, 60]
    assert out.getvalue().splitlines()[0].startswith("step      1/60  loss 5.0000")

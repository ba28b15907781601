"""The progress bar shows on a terminal only; in a log file the log lines are the progress."""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

from kiln.recipes.hooks import ProgressHook


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

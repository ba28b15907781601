"""Exact resume: N steps in one go == k steps, stop (SIGTERM), resume, N-k steps -- the same
losses bit for bit, with gradient accumulation and evaluation in between. One process in-process;
two processes (FSDP2 over gloo, forked ranks of ``NGPU=2 ./run_train.sh``), with the signal sent
to one rank only and asynchronous saves."""

from __future__ import annotations

import io
import json
import os
import signal
import time

import pytest

from kiln.components.errors import CheckpointError
from kiln.components.protocols import Hook
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests import forked
from tests.conftest import CONFIGS, REPO

TINY = [
    "--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
    "--model.ffn.hidden_dim=64", "--training.seq_len=32", "--training.global_batch=8",
    "--training.micro_batch=2", "--data.max_bytes=300000", "--data.eval_fraction=0.2",
    "--run.log_interval=1", "--run.progress_bar=false", "--run.tensorboard=false",
    "--eval.interval=3", "--eval.tokens=256", "--optimizer.lr=3e-3",
    "--checkpoint.interval=5",
]


class Record(Hook):
    def __init__(self, signal_at: int | None = None):
        self.losses: dict[int, float] = {}
        self.evals: dict[int, float] = {}
        self.signal_at = signal_at

    def on_step_end(self, trainer, result):
        self.losses[trainer.progress.step] = result.loss
        if trainer.last_eval_loss is not None:
            self.evals[trainer.progress.step] = trainer.last_eval_loss
        if trainer.progress.step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # seen at the next step boundary


def run(folder, steps, signal_at=None, extra=()):
    recipe = load_recipe(CONFIGS / "debug.toml",
                         [*TINY, f"--training.steps={steps}", f"--run.folder={folder}", *extra])
    rec = Record(signal_at)
    trainer = Trainer(recipe, hooks=[rec], out=io.StringIO())
    trainer.fit()
    return rec, trainer


def test_stop_and_resume_gives_identical_losses(tmp_path):
    full, _ = run(tmp_path / "full", 10)
    first, t1 = run(tmp_path / "cut", 10, signal_at=3)
    assert t1.stop_requested and max(first.losses) == 4  # saved at step 4, then stopped
    assert (tmp_path / "cut" / "checkpoints" / "step_0000004").is_dir()
    assert not (tmp_path / "cut" / "checkpoints" / "final").exists()
    # checkpoint.folder changed: the run started over from step 1 beside its snapshots
    with pytest.raises(CheckpointError, match=r"this run has snapshots in .*cut/checkpoints "
                       r"\(newest step_0000004\), and checkpoint.folder = 'ckpt' \(.*cut/ckpt\) "
                       "holds none, so kiln does not start the run over"):
        run(tmp_path / "cut", 10, extra=["--checkpoint.folder=ckpt"])
    with pytest.raises(CheckpointError, match=r"\(newest step_0000004\), and checkpoint.enable "
                       "= false, so kiln does not start the run over"):
        run(tmp_path / "cut", 10, extra=["--checkpoint.enable=false"])
    second, t2 = run(tmp_path / "cut", 10)  # the same command again: continues
    assert min(second.losses) == 5 and t2.progress.step == 10
    assert {**first.losses, **second.losses} == full.losses  # bit-identical, every step
    assert second.evals[6] == full.evals[6]
    ck = tmp_path / "cut" / "checkpoints"
    assert os.readlink(ck / "final") == "step_0000010"
    assert sorted(p.name for p in ck.glob("step_*")) == ["step_0000005", "step_0000010"]


def losses(run_dir) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "loss" in row:
            out[row["step"]] = row["loss"]
    return out


def _launch(args: list[str]) -> forked.Started:
    """``NGPU=2 ./run_train.sh debug.toml ARGS`` on forked ranks (torchrun's own part is tested
    in tests/parallelisms/test_run_train.py and tests/recipes/runs/test_launch.py)."""
    return forked.start(["./run_train.sh", str(CONFIGS / "debug.toml"), *args], REPO,
                        {**os.environ, "NGPU": "2"})


def cut_and_resume(folder, args: list[str], *cut_only: str):
    """Two ranks train ``args`` into ``folder`` (plus ``cut_only``); SIGTERM reaches rank 1
    once 6 steps are logged; then the same command runs again. Both runs' results and the last
    step the first one logged."""
    cut = _launch([*args, f"--run.folder={folder}", *cut_only])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # wait until training is under way, then signal rank 1
        if (folder / "metrics.jsonl").exists() and len(losses(folder)) >= 6:
            break
        time.sleep(0.05)
    os.kill(cut.pids[1], signal.SIGTERM)
    first = cut.wait(timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    stopped = max(losses(folder))
    again = _launch([*args, f"--run.folder={folder}"]).wait(timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return first, stopped, again


@pytest.mark.slow
def test_two_processes_resume_exactly_after_one_rank_is_signalled(tmp_path):
    steps = 40
    # the uninterrupted reference: the same two ranks, forked
    forked.train_ranks([str(CONFIGS / "debug.toml"), *TINY, f"--training.steps={steps}",
                        f"--run.folder={tmp_path / 'full'}"], 2, tmp_path / "full_logs")
    # The interrupted run saves in the background (dcp.async_save on its own gloo group); the
    # resumed one synchronously: an allowed recipe change, reported on resume.
    first, stopped, again = cut_and_resume(
        tmp_path / "cut", [*TINY, f"--training.steps={steps}"], "--checkpoint.async=true")
    assert stopped < steps, "the run finished before the signal arrived"
    assert f"stopped at step {stopped}" in first.stdout, first.stdout[-2000:]
    assert "resumed from" in again.stdout and "checkpoint.async: True -> False" in again.stdout
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")

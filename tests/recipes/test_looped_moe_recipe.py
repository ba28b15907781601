"""The looped-MoE debug recipe end to end (shrunk): segmented steps, exact resume with the carry,
the guard state and the MoE biases, and `kiln eval --loops` on the run it leaves."""

from __future__ import annotations

import io
import json
import os
import signal

import pytest
import torch

from kiln.components.protocols import Hook
from kiln.recipes.cli import main
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.conftest import CONFIGS

TINY = [
    "--model.dim=32", "--model.attention.n_heads=2", "--model.ffn.hidden_dim=32",
    "--model.ffn.n_experts=4", "--training.seq_len=32", "--training.global_batch=4",
    "--training.micro_batch=2", "--data.max_bytes=300000", "--data.eval_fraction=0.2",
    "--run.log_interval=1", "--run.progress_bar=false", "--run.tensorboard=false",
    "--eval.interval=0", "--eval.tokens=512", "--checkpoint.interval=2",
    "--guards.spike.warmup_steps=0", "--training.steps=4", "--model.carry=true",
]


class Record(Hook):
    def __init__(self, signal_at: int | None = None):
        self.losses: dict[int, float] = {}
        self.signal_at = signal_at

    def on_step_end(self, trainer, result):
        self.losses[trainer.progress.step] = result.loss
        if trainer.progress.step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # seen at the next step boundary


def run(folder, signal_at=None):
    recipe = load_recipe(CONFIGS / "looped_moe_debug.toml", [*TINY, f"--run.folder={folder}"])
    rec = Record(signal_at)
    trainer = Trainer(recipe, hooks=[rec], out=io.StringIO())
    trainer.fit()
    return rec, trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("looped")
    full = run(tmp / "full")
    first = run(tmp / "cut", signal_at=1)
    second = run(tmp / "cut")
    return tmp, full, first, second


def test_stop_and_resume_is_exact_with_carry_guard_and_biases(runs):
    tmp, (full, tf), (first, t1), (second, t2) = runs
    assert t1.stop_requested and max(first.losses) == 2 and min(second.losses) == 3
    assert {**first.losses, **second.losses} == full.losses  # bit-identical, every step
    model_f, model_r = tf.model, t2.model
    for (k, a), b in zip(model_f.state_dict().items(), model_r.state_dict().values(),
                         strict=True):
        assert torch.equal(a, b), k  # weights, MoE expert biases, loop scale
    carry_f, carry_r = model_f.carry_state(), model_r.carry_state()
    assert sorted(carry_f) == ["age.0", "age.1", "ended.0", "ended.1", "state.0", "state.1"]
    assert all(torch.equal(carry_f[k], carry_r[k]) for k in carry_f)
    assert tf.guards["spike"].state_dict() == t2.guards["spike"].state_dict()
    rows = [json.loads(x) for x in (tmp / "full" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "loss" in r][-1]
    assert last["segments_done"] == 2.0 and "moe/max_load" in last and "loop/scale" in last


def test_kiln_eval_sweeps_loop_counts(runs, capsys):
    tmp = runs[0]
    assert main(["eval", str(tmp / "full"), "--loops", "1,2,4", "--tokens", "256"]) == 0
    out = capsys.readouterr().out
    assert "step_0000004" in out and "deeper is better" in out
    lines = [x.split() for x in out.splitlines() if x.strip()[:1].isdigit()]
    assert [int(x[0]) for x in lines] == [1, 2, 4]
    assert main(["eval", str(tmp / "full"), "--loops", "1,4", "--tokens", "256", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["loops"] for r in result["rows"]] == [1, 4]
    assert result["rows"][1]["loss"] == pytest.approx(
        [float(x[1]) for x in lines if x[0] == "4"][0], abs=1e-4)
    assert isinstance(result["deeper_is_better"], bool)


def test_kiln_eval_rejects_bad_loop_counts(runs, capsys):
    tmp = runs[0]
    assert main(["eval", str(tmp / "full"), "--loops", "1,9"]) == 2
    assert "trained with H = 4" in capsys.readouterr().err


def test_guard_abort_writes_the_alarm_and_exits_2_without_saving(tmp_path, capsys):
    folder = tmp_path / "abort"
    # Any rise of a segment's loss over its baseline is a "spike" here, and aborts.
    status = main(["train", str(CONFIGS / "looped_moe_debug.toml"), *TINY,
                   "--training.steps=12", "--checkpoint.interval=100",
                   f"--run.folder={folder}", "--guards.spike.abort_on_spike=true",
                   "--guards.spike.delta_floor=0.000001", "--guards.spike.rel=0.0",
                   "--guards.spike.ratio=0.0", "--guards.spike.hard=0.0",
                   "--guards.spike.ema=0.0"])
    assert status == 2
    assert "kiln train: error: step" in capsys.readouterr().err
    alarm = json.loads((folder / "SPIKE_ABORT.json").read_text())
    events = [json.loads(x) for x in (folder / "spike_events.jsonl").read_text().splitlines()]
    assert alarm["abort"] is True and events[-1]["step"] == alarm["step"]
    ckpts = folder / "checkpoints"
    assert not ckpts.exists() or not any(ckpts.glob("step_*"))  # nothing saved at the abort

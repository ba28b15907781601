"""The trainer end to end on a tiny recipe: determinism, run folder contents, 1 vs 2 processes."""

from __future__ import annotations

import json
import os

import pytest

from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.step_context import TrainStepContext
from kiln.recipes.training.trainer import Trainer
from tests import forked
from tests.conftest import CONFIGS, REPO

TINY = [
    "--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
    "--model.ffn.hidden_dim=64", "--training.seq_len=32", "--training.global_batch=4",
    "--training.micro_batch=2", "--training.steps=4", "--data.max_bytes=300000",
    "--data.eval_fraction=0.2",
    "--run.log_interval=1", "--run.progress_bar=false", "--eval.interval=2",
    "--eval.tokens=256", "--checkpoint.enable=false", "--optimizer.lr=3e-3",
]


def losses(run_dir) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["loss"] for x in lines if "loss" in json.loads(x)]


def train(tmp_path, name, extra=()):
    recipe = load_recipe(CONFIGS / "debug.toml", [*TINY, f"--run.folder={tmp_path / name}", *extra])
    with open(os.devnull, "w") as sink:
        Trainer(recipe, out=sink).fit()
    return tmp_path / name


def test_same_seed_same_losses_and_run_folder_contents(tmp_path):
    a = train(tmp_path, "a")
    b = train(tmp_path, "b")
    assert losses(a) == losses(b) and len(losses(a)) == 4
    assert (a / "recipe.toml").read_text().startswith("# resolved by kiln")
    assert list((a / "tensorboard").iterdir())
    evals = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/loss" in e for e in evals)
    c = train(tmp_path, "c", ["--training.seed=1"])
    assert losses(c) != losses(a)


def test_grad_accumulation_matches_one_big_micro_batch(tmp_path):
    a = train(tmp_path, "acc", ["--training.micro_batch=1"])
    b = train(tmp_path, "big", ["--training.micro_batch=4"])
    assert losses(a) == pytest.approx(losses(b), rel=1e-4)


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    one = train(tmp_path, "one")
    # two gloo ranks forked with torchrun's variables (the launch itself: test_run_train.py)
    cmd = ["./run_train.sh", str(CONFIGS / "debug.toml"), *TINY,
           f"--run.folder={tmp_path / 'two'}", "--training.init_check=true"]
    out = forked.run(cmd, REPO, env={**os.environ, "NGPU": "2"}, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert losses(tmp_path / "two") == pytest.approx(losses(one), rel=1e-4)
    assert "init check" in out.stdout + out.stderr


def test_context_warmup_trains_shorter_sequences_first(tmp_path):
    run = train(tmp_path, "warm", ["--training.context_warmup.steps=2",
                                   "--training.context_warmup.start=8",
                                   "--training.context_warmup.multiple=8"])
    seen = [json.loads(x)["tokens_seen"] for x in (run / "metrics.jsonl").read_text().splitlines()
            if "tokens_seen" in json.loads(x)]
    # 4 sequences per step at lengths 8, 24 (8 + 1/2 * 24, rounded up to 8), then 32, 32.
    assert seen == [32, 128, 256, 384]


def _fit(recipe) -> str:
    import io

    out = io.StringIO()
    Trainer(recipe, out=out).fit()
    return out.getvalue()


def test_rerunning_a_finished_run_says_so_and_adds_nothing(tmp_path):
    args = [*TINY, "--checkpoint.enable=true", "--training.steps=2", "--eval.interval=0",
            f"--run.folder={tmp_path / 'r'}"]
    first = _fit(load_recipe(CONFIGS / "debug.toml", args))
    run = tmp_path / "r"  # the last line says where the outputs are
    assert first.splitlines()[-1] == (f"kiln: outputs in {run} "
                                      f"(tensorboard --logdir {run}/tensorboard)")
    metrics = (tmp_path / "r" / "metrics.jsonl").read_text()
    assert metrics.count('"eval/loss":') == 1
    again = _fit(load_recipe(CONFIGS / "debug.toml", args))
    assert "already finished: step 2 of 2" in again and "eval" not in again
    assert (tmp_path / "r" / "metrics.jsonl").read_text() == metrics  # no second eval/loss


def test_a_run_that_fails_before_step_1_leaves_no_folder_and_keeps_an_earlier_run(tmp_path):
    from kiln.components.errors import CheckpointError, DataError

    fresh = tmp_path / "fresh"
    with pytest.raises(DataError):
        _fit(load_recipe(CONFIGS / "debug.toml", [*TINY, f"--run.folder={fresh}",
                                                  f"--data.path={tmp_path / 'missing'}"]))
    assert not fresh.exists()
    args = [*TINY, "--checkpoint.enable=true", "--training.steps=2", f"--run.folder={tmp_path}/r"]
    _fit(load_recipe(CONFIGS / "debug.toml", args))
    before = {p: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()}
    with pytest.raises(CheckpointError, match="training.seed"):  # refused on resume
        _fit(load_recipe(CONFIGS / "debug.toml", [*args, "--training.seed=1"]))
    after = {p: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()}
    assert after == before  # the earlier run's recipe.toml, metrics and checkpoints untouched


def _nan_loss_at(monkeypatch, step: int) -> None:
    """The loss of global step ``step`` (1-based) becomes NaN."""
    forward_loss = TrainStepContext.forward_loss

    def poisoned(self, batch):
        loss = forward_loss(self, batch)
        return loss * float("nan") if self.step == step - 1 else loss

    monkeypatch.setattr(TrainStepContext, "forward_loss", poisoned)


def test_a_non_finite_step_without_a_guard_stops_before_it_writes_anything(tmp_path,
                                                                             monkeypatch):
    """Before: the NaN step trained on (NaN weights) and the save at a checkpoint step died in
    write_manifest with `ValueError: Out of range float values are not JSON compliant`."""
    from kiln.components.errors import TrainingAborted

    _nan_loss_at(monkeypatch, 4)
    with pytest.raises(TrainingAborted, match=r"step 4: not finite \(loss = nan, grad_norm = nan\) "
                       r"and the recipe has no guard.*\[guards\.spike\]"):
        train(tmp_path, "n", ["--checkpoint.enable=true", "--checkpoint.interval=2",
                              "--training.steps=6"])
    ck = tmp_path / "n" / "checkpoints"  # no half-written save, no NaN weights saved
    assert sorted(p.name for p in ck.iterdir() if "step" in p.name) == ["step_0000002"]
    assert len(losses(tmp_path / "n")) == 3  # steps 1-3 logged; step 4 never trained


def test_a_non_finite_first_step_does_not_blame_the_learning_rate(tmp_path, monkeypatch):
    """Before: step 1's NaN (differential attention with lambda_std = 7) said "Lower
    optimizer.lr", although no optimizer step had run."""
    from kiln.components.errors import TrainingAborted

    _nan_loss_at(monkeypatch, 1)
    with pytest.raises(TrainingAborted, match=r"step 1: not finite \(loss = nan, grad_norm = nan\) "
                       r"before any optimizer step, so the learning rate is not the cause") as err:
        train(tmp_path, "n", ["--training.steps=2"])
    assert "optimizer.lr" not in str(err.value)
    assert "adapter.alpha" in str(err.value)  # (alpha = 1e30 got this line without naming it)


def test_a_skipped_non_finite_step_at_a_checkpoint_step_is_saved(tmp_path, monkeypatch):
    """With a guard the NaN step is skipped, and the snapshot of that step records the loss as
    text (JSON has no NaN); before: the same ValueError from write_manifest."""
    _nan_loss_at(monkeypatch, 2)
    run = train(tmp_path, "g", ["--checkpoint.enable=true", "--checkpoint.interval=2",
                                "--guards.spike.type=spike_guard"])
    manifest = json.loads((run / "checkpoints" / "step_0000002" / "manifest.json").read_text())
    assert manifest["loss"] == "nan"

"""``train_configs/sft_debug.toml`` at tiny sizes: the assistant-token loss falls, the loss is
the same for 1 and 4 micro-batches and for 1 and 2 processes (token weighting), a stopped or
killed run resumes to the same losses, and the run logs its trained tokens."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch

from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.checkpointing.test_exact_resume import Record
from tests.conftest import CONFIGS
from tests.parallelisms.tiny import free_port, rank_env
from tests.recipes.test_mixture_recipe import _KILLED, _metrics

TINY = [
    "--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
    "--model.ffn.hidden_dim=64", "--training.seq_len=96", "--training.global_batch=8",
    "--training.micro_batch=2", "--run.log_interval=1", "--run.progress_bar=false",
    "--run.tensorboard=false", "--eval.interval=4", "--eval.tokens=768",
    "--optimizer.lr=1e-2", "--checkpoint.interval=3", "--optimizer.schedule.warmup_steps=2",
    "--data.builtin_rows=400",
]


def _recipe(folder, steps=8, extra=()):
    return load_recipe(CONFIGS / "sft_debug.toml",
                       [*TINY, f"--training.steps={steps}", f"--run.folder={folder}", *extra])


def _run(folder, steps=8, signal_at=None, extra=()):
    rec = Record(signal_at)
    trainer = Trainer(_recipe(folder, steps, extra), hooks=[rec], out=io.StringIO())
    trainer.fit()
    return rec, trainer


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    folder = tmp_path_factory.mktemp("sft") / "full"
    rec, trainer = _run(folder)
    return folder, rec, trainer


def test_the_loss_falls_and_each_step_logs_its_trained_tokens(full):
    folder, rec, trainer = full
    assert rec.losses[8] < 0.75 * rec.losses[1]
    rows = _metrics(folder)
    assert all(0 < rows[s]["trained_tokens"] < 8 * 96 for s in range(1, 9))
    assert "eval/loss" in rows[8]


def test_one_and_four_micro_batches_give_the_same_losses(full, tmp_path):
    _, ref, _ = full
    rec, _ = _run(tmp_path / "m8", extra=["--training.micro_batch=8"])
    assert rec.losses == pytest.approx(ref.losses, rel=1e-5)


def test_a_stopped_sft_run_resumes_to_the_same_losses(full, tmp_path):
    _, ref, _ = full
    first, trainer = _run(tmp_path / "cut", signal_at=3)
    assert trainer.stop_requested
    second, _ = _run(tmp_path / "cut")
    assert {**first.losses, **second.losses} == ref.losses


@pytest.mark.slow
def test_an_sft_run_killed_with_sigkill_resumes_to_the_same_losses(full, tmp_path):
    folder, ref, _ = full
    cut = tmp_path / "cut"
    done = subprocess.run([sys.executable, "-c", _KILLED, "5", str(CONFIGS / "sft_debug.toml"),
                           *TINY, "--training.steps=8", f"--run.folder={cut}"], timeout=300)
    assert done.returncode == -9 and max(_metrics(cut)) == 5
    _run(cut)
    assert {s: r["loss"] for s, r in _metrics(cut).items() if "loss" in r} == ref.losses


def _worker(rank: int, port: int, folder: str) -> None:
    from kiln.components import distributed

    rank_env(rank, 2, port)
    losses: dict = {}
    try:
        rec, _ = _run(f"{folder}/two", extra=["--parallelism.fsdp=on"])
        losses = rec.losses
    finally:
        with open(f"{folder}/rank{rank}.json", "w") as f:
            json.dump(losses, f)
        distributed.shutdown(together=sys.exc_info()[0] is None)


@pytest.mark.slow
def test_two_processes_give_the_one_process_losses(full, tmp_path):
    _, ref, _ = full
    torch.multiprocessing.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    assert [ranks[0][str(s)] for s in range(1, 9)] == pytest.approx(
        [ref.losses[s] for s in range(1, 9)], rel=1e-5)


def test_masked_data_with_a_step_that_cannot_weight_tokens_is_refused(tmp_path):
    recipe = load_recipe(CONFIGS / "looped_moe_debug.toml", [
        "--data.type=chat", "--data.template=chatml", "--data.builtin_rows=400",
        "--training.seq_len=96", f"--run.folder={tmp_path / 'x'}"])
    with pytest.raises(RecipeError, match="token-weighted.*segmented_bptt"):
        Trainer(recipe, out=io.StringIO())

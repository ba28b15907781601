"""``train_configs/dpo_debug.toml`` at tiny sizes, after ``sft_debug.toml`` as docs/finetuning.md
chains them: SFT, its Hugging Face export, DPO from it with the SFT model as the frozen
reference. The DPO run starts at log 2, scores its task and the held-out pairs in the loop, and a
run killed with SIGKILL resumes to the same losses (the reference read from the export again)."""

from __future__ import annotations

import io
import math
import sys

import pytest

from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests import forked
from tests.checkpointing.test_exact_resume import Record
from tests.conftest import CONFIGS, REPO
from tests.recipes.test_mixture_recipe import _KILLED, _metrics
from tests.recipes.test_sft_recipe import TINY as SFT_TINY

MODEL = [o for o in SFT_TINY if o.startswith("--model.")]
TINY = [*MODEL, "--training.seq_len=128", "--training.global_batch=4",
        "--training.micro_batch=2", "--run.log_interval=1", "--run.progress_bar=false",
        "--run.tensorboard=false", "--eval.interval=3", "--eval.tokens=1024",
        "--optimizer.lr=1e-3", "--checkpoint.interval=3", "--optimizer.schedule.warmup_steps=2",
        "--data.builtin_rows=200", "--data.eval_fraction=0.1", "--evals.restate.interval=3",
        "--evals.restate.limit=8", "--training.steps=6"]


@pytest.fixture(scope="module")
def sft_export(tmp_path_factory):
    """A tiny SFT run of sft_debug.toml, exported to Hugging Face."""
    from kiln.recipes.cli import main

    root = tmp_path_factory.mktemp("dpo_chain")
    recipe = load_recipe(CONFIGS / "sft_debug.toml", [*SFT_TINY, "--training.steps=4",
                                                      f"--run.folder={root / 'sft'}",
                                                      "--evals.arith.at_end=false"])
    Trainer(recipe, out=io.StringIO()).fit()
    assert main(["export", str(root / "sft" / "checkpoints" / "final"),
                 str(root / "sft-export")]) == 0
    return root / "sft-export"


def _args(base, folder):
    return [*TINY, f"--checkpoint.init_from={base}", f"--run.folder={folder}"]


def _run(base, folder):
    rec, out = Record(None), io.StringIO()
    Trainer(load_recipe(CONFIGS / "dpo_debug.toml", _args(base, folder)), hooks=[rec],
            out=out).fit()
    return rec, out.getvalue()


@pytest.mark.slow
def test_dpo_after_sft_and_its_kill_9_resume(sft_export, tmp_path):
    rec, log = _run(sft_export, tmp_path / "dpo")
    assert f"step: a frozen model from {sft_export}" in log and "reference = frozen_copy" in log
    rows = _metrics(tmp_path / "dpo")
    # the SFT model is the start: no reward yet (the loss is log 2 plus the NLL term)
    assert rows[1]["rewards/margins"] == rows[1]["rewards/chosen"] == 0
    assert rec.losses[1] == pytest.approx(math.log(2) + rows[1]["nll_loss"], abs=1e-5)
    assert {"rewards/accuracies", "logps/chosen"} <= set(rows[1])
    assert {"eval/rewards/accuracies", "eval/restate/exact_match"} <= set(rows[6])
    accuracy, n = rows[6]["eval/rewards/accuracies"], rows[6]["eval/rewards/examples"]
    assert n >= 2 and rows[6]["eval/rewards/accuracies_stderr"] == pytest.approx(
        math.sqrt(accuracy * (1 - accuracy) / (n - 1)))
    assert rows[6]["eval/rewards/fingerprint"] == rows[6]["eval/fingerprint"]
    cut = tmp_path / "cut"
    done = forked.run([sys.executable, "-c", _KILLED, "5", str(CONFIGS / "dpo_debug.toml"),
                       *_args(sft_export, cut)], REPO, timeout=300)
    assert done.returncode == -9 and max(_metrics(cut)) == 5, done.stderr[-3000:]
    _run(sft_export, cut)
    assert {s: r["loss"] for s, r in _metrics(cut).items() if "loss" in r} == rec.losses

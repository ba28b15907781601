"""``train_configs/grpo_debug.toml`` at tiny sizes: a run killed with SIGKILL in the middle of a
step's rollout, or between two micro-batches of its update, is rerun with the same command and
continues to the same losses, rewards and metrics as a run never killed (the rollouts are
regenerated from their seeds, not stored)."""

from __future__ import annotations

import io
import json
import sys

import pytest

from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests import forked
from tests.conftest import CONFIGS, REPO

TINY = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
        "--model.ffn.hidden_dim=48", "--training.global_batch=4", "--training.micro_batch=2",
        "--training.step.group_size=4", "--training.step.rollout.max_new_tokens=6",
        "--run.log_interval=1", "--run.progress_bar=false", "--run.tensorboard=false",
        "--checkpoint.interval=2", "--checkpoint.init_from=''", "--evals.restate.interval=0",
        "--evals.restate.at_end=false", "--optimizer.lr=1e-2", "--data.builtin_rows=64",
        "--training.steps=6"]

# Dies with SIGKILL inside step 5: in its rollout (the 3rd sampled token) or its update (after
# the first micro-batch's backward).
_KILLED = """
import io, os, signal, sys
from kiln.components.models import generation
from kiln.components.rollouts import kiln_generator
from kiln.components.steps import grpo_loss
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer

where, calls = sys.argv[1], {"rollout": 0, "token": 0, "aggregate": 0}
rollout, token_stats, aggregate = (kiln_generator.KilnRollout.__call__, generation.token_stats,
                                   grpo_loss.aggregate)

def counted_rollout(self, *a, **k):
    calls["rollout"] += 1
    return rollout(self, *a, **k)

def counted_token(*a, **k):
    calls["token"] += calls["rollout"] == 5
    if where == "rollout" and calls["token"] == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    return token_stats(*a, **k)

def counted_aggregate(*a, **k):
    calls["aggregate"] += 1
    if where == "update" and calls["aggregate"] == 10:  # step 5's second micro-batch
        os.kill(os.getpid(), signal.SIGKILL)
    return aggregate(*a, **k)

kiln_generator.KilnRollout.__call__ = counted_rollout
generation.token_stats = counted_token
grpo_loss.aggregate = counted_aggregate
Trainer(load_recipe(sys.argv[2], sys.argv[3:]), out=io.StringIO()).fit()
"""


def _metrics(folder) -> dict[int, dict]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k not in ("time", "interval_s",
                                                                "tokens_per_second", "mfu",
                                                                "memory_bytes", "session")}
            for r in rows if "loss" in r}


def _run(folder):
    Trainer(load_recipe(CONFIGS / "grpo_debug.toml", [*TINY, f"--run.folder={folder}"]),
            out=io.StringIO()).fit()
    return _metrics(folder)


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("grpo") / "whole")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["rollout", "update"])
def test_a_grpo_run_killed_mid_step_continues_exactly(whole, tmp_path, where):
    cut = tmp_path / "cut"
    done = forked.run([sys.executable, "-c", _KILLED, where, str(CONFIGS / "grpo_debug.toml"),
                       *TINY, f"--run.folder={cut}"], REPO, timeout=300)
    assert done.returncode == -9 and max(_metrics(cut)) == 4, done.stderr[-3000:]
    again = _run(cut)
    assert sorted(again) == list(range(1, 7))
    for step in (5, 6):
        assert again[step] == whole[step], step

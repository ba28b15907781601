"""Metrics sinks: Weights & Biases in offline mode (nothing leaves the machine) receives the
logged scalars; it is never started unless [run.wandb] is set."""

from __future__ import annotations

import io
import json

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.checkpointing.test_exact_resume import TINY
from tests.conftest import CONFIGS


def run(folder, *extra):
    recipe = load_recipe(CONFIGS / "debug.toml", [
        *TINY, "--training.steps=3", "--eval.interval=0", "--checkpoint.enable=false",
        f"--run.folder={folder}", *extra])
    Trainer(recipe, out=io.StringIO()).fit()


@pytest.mark.slow
def test_wandb_offline_receives_the_scalars(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: never online in a test
    monkeypatch.setenv("WANDB_SILENT", "true")
    run(tmp_path / "plain")
    assert not (tmp_path / "plain" / "wandb").exists()  # not configured: not started
    run(tmp_path / "wb", "--run.wandb.project=kiln-test", "--run.wandb.mode=offline",
        "--run.wandb.tags=['tiny']")
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # W&B's service process writes the run file asynchronously; this waits
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    run_id = (tmp_path / "wb" / "wandb_id.txt").read_text().strip()
    assert len(runs) == 1 and runs[0].name.endswith(run_id)
    data = next(runs[0].glob("run-*.wandb")).read_bytes()
    lines = [json.loads(x) for x in (tmp_path / "wb" / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in lines if "loss" in x][-1]
    # W&B stores each history value as JSON text: the last logged loss is in the run file
    assert b"tokens_per_second" in data and json.dumps(last["loss"]).encode() in data
    assert b"kiln-test" in data and b"tiny" in data


def test_missing_wandb_package_is_a_recipe_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(RecipeError, match="pip install wandb"):
        run(tmp_path / "x", "--run.wandb.project=p")


def test_wandb_that_cannot_start_stops_the_run_before_its_first_step(tmp_path, monkeypatch):
    """No login (or no network) is one clear line naming run.wandb and the offline mode, raised
    when the session begins: no step is trained and no metric line is written first."""
    import importlib.machinery
    import sys
    import types

    from kiln.recipes.training.metrics import MetricsWriter

    class UsageError(Exception):
        pass

    def init(**kwargs):
        raise UsageError("No API key configured. Use `wandb login` to log in.")

    fake = types.ModuleType("wandb")
    fake.__spec__, fake.init = importlib.machinery.ModuleSpec("wandb", None), init
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = types.SimpleNamespace(project="p", entity="", name="", group="", tags=[],
                                mode="online")
    writer = MetricsWriter(tmp_path, tensorboard=False, enabled=True, wandb=cfg)
    with pytest.raises(RecipeError, match=r'run\.wandb: .*No API key.*mode = "offline"'):
        writer.begin_session(0)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_each_session_marks_its_first_line_with_the_step_it_started_from(tmp_path):
    from kiln.recipes.training.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, tensorboard=False, enabled=True)
    writer.begin_session(0)
    writer.log(1, {"loss": 3.0})
    writer.log(2, {"loss": 2.0})
    writer.begin_session(1, total_steps=4)  # resumed from the step-1 checkpoint, 4 steps now
    writer.log(2, {"loss": 2.1})
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x.get("session") for x in lines] == [{"from_step": 0}, None,
                                                 {"from_step": 1, "total_steps": 4}]

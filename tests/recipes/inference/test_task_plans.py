"""``plan_evals``: what the in-loop tasks refuse before step 1, in ``kiln train`` (the downstream
hook) and ``kiln validate`` alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kiln.components.errors import RecipeError
from kiln.components.protocols import complete_model
from kiln.recipes.config.files import load_recipe
from kiln.recipes.inference.task_plans import plan_evals
from kiln.recipes.loading.meta_model import build_meta_model
from tests.conftest import CONFIGS

ONE = SimpleNamespace(tp=1, pp=1)


def _plan(overrides=(), shape=ONE, distributed=False, read=True, model=None):
    recipe = load_recipe(CONFIGS / "debug_evals.toml", ["--model.n_layers=1", *overrides])
    tokenizer = recipe.tokenizer.build()
    if model is None:
        model = build_meta_model(recipe, tokenizer)
        complete_model(model)
    logged = []
    tasks, plans, max_len = plan_evals(recipe, model, tokenizer, shape,
                                       distributed=distributed, log=logged.append, read=read)
    return tasks, plans, max_len


def test_the_tasks_are_read_and_planned_before_the_first_step():
    tasks, plans, max_len = _plan()
    assert set(tasks) == set(plans) == {"python_mc", "python_em"}
    assert max_len == 256 and all(p.examples for p in plans.values())
    tasks, plans, _ = _plan(["--evals.python_mc.path=no/such.jsonl"], read=False)
    assert set(tasks) == {"python_mc", "python_em"} and plans == {}  # validate --no-data


@pytest.mark.parametrize("shape, key", [(SimpleNamespace(tp=2, pp=1), "parallelism.tp = 2"),
                                        (SimpleNamespace(tp=1, pp=2), "parallelism.pp = 2")])
def test_tasks_under_tensor_or_pipeline_parallelism_are_refused(shape, key):
    with pytest.raises(RecipeError, match=rf"do not run under .* parallelism yet \({key}\)"):
        _plan(shape=shape)


def test_a_pause_without_snapshots_is_refused():
    with pytest.raises(RecipeError, match=r'evals.python_em.mode = "pause" saves a snapshot'):
        _plan(["--evals.python_em.mode=pause", "--checkpoint.enable=false"])
    assert "python_em" not in _plan(["--evals.python_em.mode=pause"])[0]  # not run inline


def test_generation_on_several_processes_needs_a_kv_cache():
    class NoCache(SimpleNamespace):  # a model with no attention kiln can cache
        def blocks(self):
            return []

    with pytest.raises(RecipeError, match="task 'python_em' generates text on several"):
        _plan(distributed=True, model=NoCache(max_seq_len=256))
    assert _plan(distributed=True)[0]  # kiln's attention has a cache
    assert _plan(distributed=False, model=NoCache(max_seq_len=256))[0]

"""The ``mixture`` dataset in the combination matrix (``test_combinations``): every family x step
x float8 x activation checkpointing trains on a two-source, two-stage mixture with its
per-source loss; on 2 gloo processes (FSDP2) the ranks agree with one process, every collective
on the world's device, and a 2-process checkpoint taken before the stage switch resumes on one
process through the switch to the uninterrupted run's losses (elastic resume)."""

from __future__ import annotations

import io
import json
import math

import pytest

from kiln.recipes.config.files import load_recipe
from tests import forked
from tests.collective_spy import spied_rank
from tests.conftest import CONFIGS
from tests.parallelisms.tiny import free_port
from tests.recipes.test_combinations import (
    STEP_DATA,
    STEPS,
    TINY,
    ac_modes,
    discovered,
    steps_for,
    train,
)

MIX = ("--data.type=mixture", "--data.weights={a = 2, b = 1}",
       "--data.stages=[{step = 1, weights = {b = 1, a = 1}}]",
       "--data.sources.a.type=packed_documents", "--data.sources.a.max_bytes=300000",
       "--data.sources.a.eval_fraction=0.2", "--data.sources.b.type=packed_documents",
       "--data.sources.b.source=stdlib_docstrings", "--data.sources.b.max_bytes=100000",
       "--data.sources.b.eval_fraction=0.2")


def mixture_recipe(family: str, folder, *extra: str):
    file, overrides = discovered()[family]
    keep = [o for o in TINY if not o.startswith("--data.")]
    return load_recipe(CONFIGS / file, [*keep, *overrides, *MIX, f"--run.folder={folder}",
                                        *extra])


def _source_losses(folder) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        got = {k: v for k, v in row.items() if k.startswith("train/loss/")}
        if got:
            out.setdefault(row["step"], {}).update(got)
    return out


_reference: dict[tuple, list[float]] = {}


def text_steps(family: str) -> list[str]:
    """The steps that train on text: a mixture of text sources has no preference pairs (the
    preference step refuses it: ``test_the_preference_step_refuses_a_mixture_of_text``)."""
    return [s for s in steps_for(family) if s not in STEP_DATA]


@pytest.mark.matrix
@pytest.mark.parametrize("family, step, float8, ac", [
    pytest.param(f, s, f8, ac, id=f"{f}-{s}-f8_{f8}-{ac}") for f in discovered()
    for s in text_steps(f) for f8 in ("off", "rowwise") for ac in ("none", "full")])
def test_a_mixture_trains_in_every_combination(tmp_path, family, step, float8, ac):
    args = [f"--parallelism.float8={float8}", f"--training.step.type={step}"]
    if step == "segmented_bptt":
        args.append("--training.step.segment_loops=1")
    losses, _ = train(mixture_recipe(family, tmp_path / "run", *ac_modes()[ac], *args))
    assert len(losses) == STEPS and all(map(math.isfinite, losses)), losses
    per_source = _source_losses(tmp_path / "run")
    assert sorted(per_source) == list(range(1, STEPS + 1))
    assert all(math.isfinite(v) for row in per_source.values() for v in row.values())
    key = (family, step, float8)
    if key not in _reference:
        _reference[key] = train(mixture_recipe(family, tmp_path / "ref", *ac_modes()["none"],
                                               *args))[0]
    assert losses == _reference[key]  # recomputation changes nothing


ELASTIC = ("--checkpoint.enable=true", "--checkpoint.interval=1", "--training.steps=3")


def test_the_preference_step_refuses_a_mixture_of_text(tmp_path):
    from kiln.components.errors import RecipeError
    from kiln.recipes.commands.validate import describe

    recipe = mixture_recipe("dense", tmp_path / "run", "--training.step.type=preference")
    with pytest.raises(RecipeError, match="data.type = 'mixture' has none"):
        describe(recipe)


def _worker(rank: int, port: int, folder: str) -> None:
    from kiln.recipes.training.trainer import Trainer
    from tests.checkpointing.elastic import StopAfter

    with spied_rank(rank, 2, port, folder) as results:
        for family in ("dense", "looped_moe"):
            results[family], _ = train(mixture_recipe(family, f"{folder}/{family}2",
                                                      "--parallelism.fsdp=on"))
        results["full"], _ = train(mixture_recipe("dense", f"{folder}/full2", *ELASTIC))
        recipe = mixture_recipe("dense", f"{folder}/cut", *ELASTIC)
        Trainer(recipe, hooks=[StopAfter(1)], out=io.StringIO()).fit()  # saved at step 1


@pytest.mark.slow
def test_two_processes_train_a_mixture_and_resume_it_on_one_through_the_stage_switch(tmp_path):
    forked.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for family in ("dense", "looped_moe"):
        assert ranks[0][family] == ranks[1][family], family
        one, _ = train(mixture_recipe(family, tmp_path / f"{family}1"))
        assert ranks[0][family] == pytest.approx(one, rel=1e-5), family
        two, single = _source_losses(tmp_path / f"{family}2"), _source_losses(
            tmp_path / f"{family}1")
        assert two.keys() == single.keys() and all(
            two[s] == pytest.approx(single[s], rel=1e-5) for s in two), family
    out = io.StringIO()
    train(mixture_recipe("dense", tmp_path / "cut", *ELASTIC), out=out)
    assert "layout: 2 processes" in out.getvalue() and "-> 1 process" in out.getvalue()
    resumed, full = _source_losses(tmp_path / "cut"), _source_losses(tmp_path / "full2")
    assert set(resumed) == {1, 2, 3}
    for step in (2, 3):  # the second stage (from step index 1) after the resume
        assert resumed[step] == pytest.approx(full[step], rel=1e-5), step
    for r, res in enumerate(ranks):
        spy = res["spy"]
        assert spy["calls"] > 20, spy
        assert not spy["wrong_device"], f"rank {r}: " + "\n".join(spy["wrong_device"])
        assert not spy["direct_calls"], f"rank {r}: " + "\n".join(spy["direct_calls"])

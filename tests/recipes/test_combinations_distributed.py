"""The combination matrix on 2 gloo processes (``test_combinations`` holds the cases and the
one-process matrix). One spawn trains every family under FSDP2 (the health check's and the
training's collectives checked by the spy), tensor, expert, context and pipeline parallel, the
downstream tasks and a replicated run, each saved; the FSDP2 checkpoints then resume on one
process (elastic resume), the others one step further. A second spawn checks that module
diagnostics under FSDP2 and tensor parallel are of the full tensors.
"""

from __future__ import annotations

import io
import json
import math

import pytest

from tests import forked
from tests.collective_spy import spied_rank
from tests.parallelisms.tiny import free_port
from tests.recipes.test_combinations import (
    CHUNK,
    DIAGNOSTICS,
    DOC_MASK,
    PAIRS,
    STEPS,
    discovered,
    recipe_for,
    train,
)

# ------------------------------------------------------------------- 2 processes, FSDP2
FSDP2_SAVED = ("--parallelism.fsdp=on", "--training.init_check=true", CHUNK,
               "--checkpoint.enable=true")
# context parallel with the document mask, a looped MoE core under segmented BPTT, full
# activation checkpointing, float8 and the chunked loss
CP2 = ("--parallelism.cp=2", *DOC_MASK, "--parallelism.activation_checkpoint=full",
       "--parallelism.float8=rowwise", CHUNK)


DPO = {"dpo": ("--training.step.type=preference",),
       "dpo_lora": ("--training.step.type=preference", "--adapter.rank=2",
                    "--adapter.allow_random_base=true", "--model.tie_embeddings=false"),
       # the reference's log-probabilities computed once over both ranks, stored, read again
       "dpo_pre": ("--training.step.type=preference",
                   "--training.step.precompute_reference=true"),
       # KTO on unpaired examples: its KL estimate is the mean over both ranks
       "kto": ("--training.step.type=preference", "--training.step.loss.type=kto",
               f"--data.path={PAIRS / 'sums_unpaired.jsonl'}"),
       # GRPO: each rank samples its prompts' groups (per-completion seeds: the same
       # completions as one process), the KL to a frozen reference sharded as the policy
       # dynamic sampling: ranks refill their equal groups in step with each other
       "grpo": ("--training.step.type=grpo", "--training.step.beta=0.1",
                "--training.step.dynamic_sampling=true")}


def _step(name: str) -> str:
    return "grpo" if name == "grpo" else "preference"


# expert parallel's all-to-all holds SwiGLU experts, not the moe family's gpt-oss experts
SWIGLU_EXPERTS = "--model.ffn.experts=swiglu"


def _worker(rank: int, port: int, folder: str, families: list[str]) -> None:
    with spied_rank(rank, 2, port, folder) as results:
        for family in families:  # FSDP2 (the default with 2 processes), saved at the end
            recipe = recipe_for(family, f"{folder}/{family}", *FSDP2_SAVED)
            results[family], _ = train(recipe, eval_first=True)
        # Tensor parallel (dense, loss parallel, float8 rowwise) and expert parallel (MoE
        # all-to-all) on 2 ranks; each saved (DCP, DTensor layouts) and resumed one step further
        for name, family, flags in (
            ("tp2", "dense", ("--parallelism.tp=2", "--parallelism.float8=rowwise", CHUNK)),
            ("ep2", "moe", ("--parallelism.ep=2", SWIGLU_EXPERTS)),
            ("cp2", "looped_moe", CP2),
            ("pp2", "moe", ("--parallelism.pp=2", "--parallelism.float8=rowwise", CHUNK,
                            "--parallelism.activation_checkpoint=full")),
        ):
            args = (*flags, "--checkpoint.enable=true")
            results[name], trainer = train(recipe_for(family, f"{folder}/{name}", *args))
            results[f"{name}_plan"] = trainer.parallel_summary
            results[f"{name}_resumed"], _ = train(recipe_for(
                family, f"{folder}/{name}", *args, f"--training.steps={STEPS + 1}"))
        # Preference tuning and GRPO under FSDP2 (a frozen reference sharded as the policy;
        # LoRA with the adapters switched off as the reference), saved for the elastic resume
        for name, extra in DPO.items():
            results[name], _ = train(recipe_for("dense", f"{folder}/{name}", *FSDP2_SAVED,
                                                *extra, step=_step(name)))
        # Downstream tasks under FSDP2: batches split over the ranks, scores reduced
        from tests.recipes.hooks.test_downstream import task_flags

        results["evals"], _ = train(recipe_for("dense", f"{folder}/evals", *task_flags(
            None, path=f"{folder}/tasks.jsonl")))
        # Replicated (gradient all-reduce), checkpoint saved, then resumed one step further:
        # every other collective kiln makes (verify on load, the stop/save flags of preemption,
        # the wall-clock budget and time-based saves, eval, MoE loads).
        args = ("--parallelism.fsdp=off", "--checkpoint.enable=true", "--eval.at_end=true",
                "--training.max_hours=1", "--checkpoint.interval_minutes=0.0001")
        results["replicated"], trainer = train(recipe_for("looped_moe", f"{folder}/r", *args))
        results["world_device"] = str(trainer.world.device)
        results["resumed"], _ = train(recipe_for("looped_moe", f"{folder}/r", *args,
                                                 f"--training.steps={STEPS + 1}"))


@pytest.mark.slow
def test_two_processes_fsdp2_every_family_and_collectives_on_the_world_device(tmp_path):
    from tests.components.tasks import samples
    from tests.recipes.hooks.test_downstream import metrics_of, task_flags

    families = list(discovered())
    samples.write_jsonl(tmp_path / "tasks.jsonl", samples.rows(6))
    forked.spawn(_worker, args=(free_port(), str(tmp_path), families), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for family in families:
        losses = ranks[0][family]
        assert len(losses) == STEPS and all(map(math.isfinite, losses)), (family, losses)
        assert ranks[1][family] == losses, f"{family}: ranks disagree"
    assert len(ranks[0]["replicated"]) == STEPS and len(ranks[0]["resumed"]) == 1
    one, _ = train(recipe_for("dense", tmp_path / "evals1",
                              *task_flags(None, path=tmp_path / "tasks.jsonl")))
    two, single = metrics_of(tmp_path / "evals")[STEPS], metrics_of(tmp_path / "evals1")[STEPS]
    assert ranks[1]["evals"] == ranks[0]["evals"] and len(one) == STEPS
    keys = [k for k in single if k.startswith("eval/") and k.count("/") == 2]
    scores = [k for k in keys if not k.endswith(("_stderr", "/examples", "/fingerprint"))]
    assert len(scores) == 5 and {k: two[k] for k in keys} == pytest.approx(
        {k: single[k] for k in keys}, abs=1e-6)  # standard errors, counts, fingerprints too
    assert "tensor parallel 2" in ranks[0]["tp2_plan"] and "float8" in ranks[0]["tp2_plan"]
    assert "expert parallel 2" in ranks[0]["ep2_plan"]
    assert "context parallel 2" in ranks[0]["cp2_plan"]
    assert "pipeline 2" in ranks[0]["pp2_plan"] and "float8" in ranks[0]["pp2_plan"]
    for name in ("tp2", "ep2", "cp2", "pp2"):
        losses = ranks[0][name]
        assert len(losses) == STEPS and all(map(math.isfinite, losses)), (name, losses)
        assert ranks[1][name] == losses, f"{name}: ranks disagree"
        assert len(ranks[0][f"{name}_resumed"]) == 1, name  # loaded step STEPS, took one more
    for family in families:  # elastic resume: each family's FSDP2 checkpoint, on 1 process
        out = io.StringIO()
        losses, _ = train(recipe_for(family, tmp_path / family, *FSDP2_SAVED,
                                     f"--training.steps={STEPS + 1}"), out=out)
        assert len(losses) == 1 and math.isfinite(losses[0]), (family, losses)
        assert "layout: 2 processes, dp_replicate=1 x dp_shard=2, FSDP -> 1 process" \
            in out.getvalue(), (family, out.getvalue())
    for name, extra in DPO.items():  # 2 processes equal 1; the checkpoint resumes on 1
        assert ranks[1][name] == ranks[0][name], f"{name}: ranks disagree"
        one, _ = train(recipe_for("dense", tmp_path / f"{name}1", *FSDP2_SAVED, *extra,
                                  step=_step(name)))
        assert ranks[0][name] == pytest.approx(one, rel=1e-5, abs=1e-6), name
        out = io.StringIO()
        losses, _ = train(recipe_for("dense", tmp_path / name, *FSDP2_SAVED, *extra,
                                     f"--training.steps={STEPS + 1}", step=_step(name)),
                          out=out)
        assert len(losses) == 1 and math.isfinite(losses[0]), (name, losses)
        assert "-> 1 process" in out.getvalue(), name
    # the tensor / expert / pipeline parallel checkpoints (step STEPS + 1) on one process, one
    # step further
    for name, family, flags, mesh in (
        ("tp2", "dense", ("--parallelism.float8=rowwise", CHUNK),
         "dp_replicate=1 x dp_shard=1 x tp=2"),
        ("ep2", "moe", (SWIGLU_EXPERTS,), "dp_replicate=1 x dp_shard=2 x ep=2, FSDP"),
        ("cp2", "looped_moe", CP2[1:], "dp_replicate=1 x dp_shard=1 x cp=2, FSDP"),
        ("pp2", "moe", ("--parallelism.float8=rowwise", CHUNK),
         "pp=2 x dp_replicate=1 x dp_shard=1"),
    ):
        out = io.StringIO()
        losses, _ = train(recipe_for(family, tmp_path / name, *flags, "--checkpoint.enable=true",
                                     f"--training.steps={STEPS + 2}"), out=out)
        assert len(losses) == 1 and math.isfinite(losses[0]), (name, losses)
        assert f"layout: 2 processes, {mesh} -> 1 process" \
            in out.getvalue(), (name, [x for x in out.getvalue().splitlines() if "layout" in x])
    for r, res in enumerate(ranks):
        spy = res["spy"]
        assert res["world_device"] == "cpu"
        assert spy["calls"] > 50, spy  # the spy did see the run's collectives
        assert not spy["wrong_device"], f"rank {r}: " + "\n".join(spy["wrong_device"])
        assert not spy["direct_calls"], f"rank {r}: " + "\n".join(spy["direct_calls"])


# ------------------------------------------- 2 processes: diagnostics of the full tensors
DIAG_CELLS = (("fsdp2", "looped_moe", ("--parallelism.fsdp=on",)),
              ("tp2", "dense", ("--parallelism.tp=2",)))


def _diag_worker(rank: int, port: int, folder: str) -> None:
    with spied_rank(rank, 2, port, folder) as results:
        for name, family, flags in DIAG_CELLS:
            results[name], _ = train(recipe_for(family, f"{folder}/{name}", *DIAGNOSTICS,
                                                "--training.steps=1", *flags))


def _diag_line(folder) -> dict:
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    return next(x for x in lines if "diag/act/layer0/rms" in x)


@pytest.mark.slow
def test_two_processes_diagnostics_are_of_the_full_tensors(tmp_path):
    """FSDP2 (looped MoE) and tensor parallel (dense) on 2 gloo ranks log the figures one
    process logs for the same global batch: reduced over ranks, not one rank's shard or rows."""
    forked.spawn(_diag_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for name, family, _ in DIAG_CELLS:
        assert ranks[0][name] == ranks[1][name], name
        one, _ = train(recipe_for(family, tmp_path / f"one_{name}", *DIAGNOSTICS,
                                  "--training.steps=1"))
        assert one == pytest.approx(ranks[0][name], rel=1e-5), name
        want, got = _diag_line(tmp_path / f"one_{name}"), _diag_line(tmp_path / name)
        keys = {k for k in want if k.startswith("diag/")}
        assert keys == {k for k in got if k.startswith("diag/")}, name
        off = {k: (want[k], got[k]) for k in keys if got[k] != pytest.approx(want[k], rel=1e-3)}
        assert not off, f"{name}: {off}"
    for r, res in enumerate(ranks):
        assert not res["spy"]["wrong_device"], f"rank {r}: {res['spy']['wrong_device']}"
        assert not res["spy"]["direct_calls"], f"rank {r}: {res['spy']['direct_calls']}"

"""Pipeline parallelism on gloo processes: ``pp = 2`` equals one process (dense, MoE,
differential attention, DeepSeek-V3's and Qwen3-Next's blocks; GPipe, 1F1B, interleaved 1F1B,
interleaved zero bubble, ZBV, DualPipeV; the final evaluation included), checkpoints resume
across pipeline layouts (pp 2 -> 1, 1 -> 2 with another split), and on 4 processes pp 2 with
FSDP2, HSDP, tensor parallel and expert parallel inside each stage. The recipes are the
combination test's tiny ones."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests import forked
from tests.parallelisms.tiny import free_port, rank_env
from tests.recipes.test_combinations import STEPS, recipe_for

pytestmark = pytest.mark.slow

EVAL = ("--eval.at_end=true",)
SAVE = ("--checkpoint.enable=true",)
CASES = {  # name -> (family, overrides)
    "dense_1f1b": ("dense", ("--parallelism.pp=2", *EVAL, *SAVE)),
    # DeepSeek-V3's blocks (latent attention, a dense layer, grouped experts) without its
    # multi-token prediction module, which pipeline parallelism refuses
    "deepseek_interleaved": ("deepseek", ("--model.n_layers=4", "--model.mtp_depth=0",
                                          "--model.tie_embeddings=false", "--parallelism.pp=2",
                                          "--parallelism.pp_schedule=interleaved_1f1b", *EVAL)),
    "moe_gpipe": ("moe", ("--model.n_layers=3", '--model.layer_types=["sliding","full","full"]',
                          "--parallelism.pp=2",
                          "--parallelism.pp_schedule=gpipe", *EVAL)),
    "diff_izb": ("diff_layerscale", ("--model.n_layers=4", "--parallelism.pp=2",
                                     "--parallelism.pp_schedule=interleaved_zero_bubble")),
    # V schedules: the first and the last stage (and the tied embedding) on one rank
    "dense_zbv": ("dense", ("--model.n_layers=4", "--parallelism.pp=2",
                            "--parallelism.pp_schedule=zbv_zero_bubble", *EVAL)),
    "dense_dualpipev": ("dense", ("--model.n_layers=4", "--parallelism.pp=2",
                                  "--parallelism.pp_schedule=dualpipev",
                                  "--training.micro_batch=1")),
    # two pipeline runs per step, a shorter first step (a schedule per length), a guard; on
    # Qwen3-Next's blocks (a Gated DeltaNet layer on each stage's side of the cut)
    "qwen3_next_runs_warmup_guard": ("qwen3_next", (
        "--parallelism.pp=2", "--parallelism.pp_schedule=gpipe", "--parallelism.pp_microbatches=1",
        "--training.context_warmup.steps=1", "--training.context_warmup.start=16",
        "--training.context_warmup.multiple=8", "--guards.spike.type=spike_guard",
        "--guards.spike.warmup_steps=0")),
}
FOUR = {  # 4 processes: pp 2 x (FSDP2 2 | HSDP 2 x 1 | tensor parallel 2 | expert parallel 2)
    "dense_fsdp2": ("dense", ("--parallelism.pp=2", *EVAL)),
    "dense_hsdp": ("dense", ("--parallelism.pp=2", "--parallelism.dp_replicate=2",
                             "--parallelism.fsdp=on")),
    "dense_tp2": ("dense", ("--parallelism.pp=2", "--parallelism.tp=2", *EVAL)),
    "moe_ep2": ("moe", ("--parallelism.pp=2", "--parallelism.ep=2", *EVAL,
                        "--model.ffn.experts=swiglu")),  # all-to-all: SwiGLU experts
}
PP_FLAGS = ("--parallelism.pp", "--parallelism.tp", "--parallelism.ep",
            "--parallelism.dp_replicate")


def _plain(flags: tuple[str, ...]) -> list[str]:
    return [f for f in flags if not f.startswith(PP_FLAGS)]


class _Record:
    """Every step's (loss, grad norm)."""

    def __init__(self) -> None:
        self.steps: list[tuple[float, float | None]] = []

    def on_train_start(self, trainer) -> None:
        pass

    def on_step_end(self, trainer, result) -> None:
        self.steps.append((result.loss, result.grad_norm))

    def on_train_end(self, trainer) -> None:
        pass

    def close(self, trainer) -> None:
        pass


def _run(recipe) -> dict:
    """Train ``recipe``: its steps, final evaluation loss and parallelism summary."""
    from kiln.recipes.training.trainer import Trainer

    record = _Record()
    with open(os.devnull, "w") as sink:
        trainer = Trainer(recipe, hooks=[record], out=sink)
        trainer.fit()
    return {"losses": record.steps, "eval": trainer.last_eval_loss,
            "plan": trainer.parallel_summary}


def _worker(rank: int, world: int, port: int, folder: str, names: list[str],
            extra: tuple[str, ...]) -> None:
    from kiln.components import distributed

    rank_env(rank, world, port)
    results: dict = {}
    try:
        for name in names:
            family, flags = {**CASES, **FOUR}[name]
            results[name] = _run(recipe_for(family, f"{folder}/{name}", *flags, *extra))
        if world == 2:  # the parent's 1-process checkpoint (step STEPS) on pp = 2
            results["resumed"] = _run(recipe_for(
                "dense", f"{folder}/one", "--model.n_layers=3", "--parallelism.pp=2",
                "--parallelism.pp_split=[2,1]", *SAVE, f"--training.steps={STEPS + 1}"))
    finally:
        with open(f"{folder}/rank{rank}.json", "w") as f:
            json.dump(results, f)
        distributed.shutdown(together=sys.exc_info()[0] is None)


def _spawn(tmp_path, world: int, names: list[str], extra: tuple[str, ...] = ()) -> list[dict]:
    forked.spawn(_worker, args=(world, free_port(), str(tmp_path), names, extra),
                 nprocs=world)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


def _close(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (loss, norm), (loss_ref, norm_ref) in zip(got, want, strict=True):
        assert loss == pytest.approx(loss_ref, rel=1e-5) and norm == pytest.approx(norm_ref,
                                                                                    rel=1e-5)


def _same_eval(got: float | None, want: float | None, name: str) -> None:
    """The final evaluation loss, or none on both sides (pytest 9.2's approx refuses None)."""
    if want is None:
        assert got is None, name
    else:
        assert got == pytest.approx(want, rel=1e-5), name


def test_pp2_equals_one_process_and_resumes_across_pipeline_layouts(tmp_path):
    names = list(CASES)
    reference = {name: _run(recipe_for(family, tmp_path / f"ref_{name}", *_plain(flags)))
                 for name, (family, flags) in CASES.items()}
    # a 1-process checkpoint at step STEPS, resumed below on pp = 2 with the split [2, 1]
    one = ("--model.n_layers=3", *SAVE)
    _run(recipe_for("dense", tmp_path / "one", *one))
    longer = _run(recipe_for("dense", tmp_path / "ref_longer", "--model.n_layers=3",
                             f"--training.steps={STEPS + 2}"))
    ranks = _spawn(tmp_path, 2, names)
    for name in names:
        got = ranks[0][name]
        assert "pipeline 2" in got["plan"], got["plan"]
        _close(got["losses"], reference[name]["losses"])
        assert ranks[1][name]["losses"] == got["losses"], f"{name}: ranks disagree"
        _same_eval(got["eval"], reference[name]["eval"], name)
    # 1 process -> pp = 2: step STEPS + 1 as one process takes it
    _close(ranks[0]["resumed"]["losses"], longer["losses"][STEPS:STEPS + 1])
    # pp = 2 -> 1 process: the pp checkpoint (step STEPS + 1) one step further
    back = _run(recipe_for("dense", tmp_path / "one", *one, f"--training.steps={STEPS + 2}"))
    _close(back["losses"], longer["losses"][STEPS + 1:])
    # the dense pp checkpoint (step STEPS) on one process, one step further
    family, flags = CASES["dense_1f1b"]
    again = _run(recipe_for(family, tmp_path / "dense_1f1b", *_plain(flags),
                            f"--training.steps={STEPS + 1}"))
    assert len(again["losses"]) == 1
    ref3 = _run(recipe_for(family, tmp_path / "ref3", *_plain(flags),
                           f"--training.steps={STEPS + 1}"))
    _close(again["losses"], ref3["losses"][STEPS:])


def test_pp2_with_fsdp2_tensor_and_expert_parallel_on_four_processes(tmp_path):
    """pp = 2 x dp_shard = 2: each stage FSDP2-sharded over its 2 ranks, the tied embedding's
    shards summed between the first and the last stage of each data-parallel rank; HSDP
    (dp_replicate = 2) inside each stage; pp = 2 x
    tp = 2: sequence-parallel slices cross the stage boundary, loss parallel on the last stage;
    pp = 2 x ep = 2: each stage's experts split over its 2 ranks."""
    flags = ("--training.global_batch=8", "--training.micro_batch=2")
    ranks = _spawn(tmp_path, 4, list(FOUR), flags)
    for name, (family, case) in FOUR.items():
        reference = _run(recipe_for(family, tmp_path / f"ref_{name}", *_plain(case), *flags))
        got = ranks[0][name]
        assert "pipeline 2" in got["plan"], got["plan"]
        _close(got["losses"], reference["losses"])
        _same_eval(got["eval"], reference["eval"], name)
        assert all(r[name]["losses"] == got["losses"] for r in ranks), name
    assert "FSDP2 over 2 ranks" in ranks[0]["dense_fsdp2"]["plan"]
    assert "HSDP over 2 ranks (shard 1 x replicate 2)" in ranks[0]["dense_hsdp"]["plan"]
    assert "tensor parallel 2" in ranks[0]["dense_tp2"]["plan"]
    assert "expert parallel 2" in ranks[0]["moe_ep2"]["plan"]

"""Every combination trains: each model family kiln ships x activation checkpointing x step x
float8 (with evaluating before the first step crossed pairwise, ``cases``) builds a tiny model
and takes 2 optimizer steps, finite and deterministic. Options that each work alone must also
work together (issue 10: MoE under activation checkpointing crashed on step 1 while both had
passing tests of their own).

The families cover every registered model, attention, feed-forward, norm and position component;
one that no family names joins on the dense transformer (``discovered``): no edit here needed.
The chunked loss runs in every family beside the unchunked one, the document mask in every
family and step under the checkpointing modes, the hang watchdog in every run. The same cases
on 2 gloo processes (FSDP2, tensor, expert, context and pipeline parallel, elastic resume, the
device check of every collective) are in ``test_combinations_distributed``; fine-tuning, data
mixtures and float8's kernel in the other ``test_combinations_*`` modules.
"""

from __future__ import annotations

import functools
import json
import math
import os
import typing
from pathlib import Path

import pytest

from kiln.components import registry
from kiln.parallelisms.config import ParallelismConfig
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS

STEPS = 2
TINY = ("--training.seq_len=32", "--training.global_batch=4", "--training.micro_batch=2",
        f"--training.steps={STEPS}", "--data.max_bytes=300000", "--data.eval_fraction=0.2",
        "--run.log_interval=1", "--run.progress_bar=false", "--run.tensorboard=false",
        "--eval.interval=0", "--eval.at_end=false", "--eval.tokens=128",
        "--checkpoint.enable=false", "--training.mixed_precision=none",
        "--parallelism.compile=false", "--parallelism.float8=off",
        "--parallelism.param_dtype=float32", "--parallelism.reduce_dtype=float32",
        "--parallelism.float8_min_dim=16", "--run.health_check.size_mb=0.5")
DENSE = ("--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
         "--model.ffn.hidden_dim=64")

# name -> (recipe, overrides). Every model family kiln ships, at toy size.
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "dense": ("debug.toml", DENSE),
    # gpt-oss's blocks: learned sinks, a window on layer 0 shorter than the cells' rows (16
    # tokens: 6 windows of 3, so it runs banded, attention/banded.py), its biased experts
    # with the clamped SwiGLU and a router bias
    "moe": ("debug.toml", (*DENSE, "--model.ffn.type=moe", "--model.ffn.n_experts=4",
                           "--model.ffn.experts=gpt_oss", "--model.ffn.router_bias=true",
                           "--model.ffn.top_k=2", "--model.ffn.hidden_dim=32",
                           "--model.ffn.aux_loss_coeff=0.01", "--model.ffn.n_shared_experts=1",
                           "--model.attention.window=3", "--model.attention.sinks=true",
                           '--model.layer_types=["sliding","full"]')),
    # DeepSeek-V3's blocks: latent attention (a query latent too), a dense layer, then
    # sigmoid-routed experts in groups; one multi-token prediction module
    "deepseek": ("debug.toml", (*DENSE, "--model.mtp_depth=1", "--model.attention.type=latent",
                                "--model.dense_layers=1", "--model.dense_ffn.hidden_dim=64",
                                "--model.attention.q_rank=16", "--model.attention.kv_rank=16",
                                "--model.attention.nope_head_dim=8",
                                "--model.attention.rope_head_dim=8", "--model.ffn.type=moe",
                                "--model.ffn.n_experts=4", "--model.ffn.score=sigmoid",
                                "--model.ffn.n_groups=2", "--model.ffn.topk_groups=1",
                                "--model.ffn.hidden_dim=32", "--model.ffn.n_shared_experts=1",
                                "--model.ffn.route_scale=2.5")),
    # Qwen3-Next's blocks: Gated DeltaNet layers beside full attention with an output gate and
    # partial RoPE; softmax experts with a gated shared expert
    "qwen3_next": ("debug.toml", (*DENSE, '--model.layer_types=["linear","full"]',
                                  "--model.linear_attention.type=gated_deltanet",
                                  "--model.linear_attention.n_heads=2",
                                  "--model.linear_attention.head_dim=16",
                                  "--model.linear_attention.chunk_size=8",
                                  "--model.attention.output_gate=true",
                                  "--model.attention.qk_norm=true",
                                  "--model.attention.position.fraction=0.5",
                                  "--model.ffn.type=moe", "--model.ffn.n_experts=4",
                                  "--model.ffn.hidden_dim=32", "--model.ffn.n_shared_experts=1",
                                  "--model.ffn.shared_gate=true")),
    # 8-bit AdamW eager (its compile: test_adamw8bit, tests/nova_dist.py); µP at twice its base
    # width (Muon spectral) and Qwen3-Next's output gate meet every cell here
    "diff_layerscale": ("nova_debug.toml", (*DENSE, "--model.attention.n_kv_heads=1",
                                            "--optimizers.adamw.compile=false",
                                            "--model.attention.output_gate=true",
                                            "--model.parametrization=mup", "--model.base_dim=16",
                                            "--optimizers.muon.lr_scaling=spectral")),
    "looped_moe": ("looped_moe_debug.toml", (
        "--model.dim=32", "--model.attention.n_heads=2", "--model.ffn.n_experts=4",
        "--model.ffn.hidden_dim=32", "--model.ffn.aux_loss_coeff=0.01",
        "--model.layerscale_init=0.1", "--model.loops=2")),  # 2 loops: 2 segments of 1
    # GPT-2's block: LayerNorm, tanh-GELU MLP and attention with biases, learned absolute
    # positions instead of RoPE, dropout (residual, embedding, attention probabilities)
    "gpt2": ("debug.toml", (*DENSE, "--model.attention.bias=true", "--model.dropout=0.1",
                            "--model.attention.dropout=0.1",
                            "--model.attention.position.type=none",
                            "--model.absolute_positions=true", "--model.max_seq_len=128",
                            "--model.norm.type=layernorm", "--model.ffn.type=mlp",
                            "--model.ffn.activation=gelu_tanh", "--model.ffn.bias=true")),
}


def _names(recipe) -> set[tuple[str, str]]:
    m = recipe.model
    linear = getattr(m, "linear_attention", None)
    return {("model", m.type), ("attention", m.attention.type), ("ffn", m.ffn.type),
            ("norm", m.norm.type), ("position", m.attention.position.type),
            *([("attention", linear.type)] if linear is not None else [])}


# The recipe key each discovered kind is swapped at (the model's own table by default).
SWAP_KEYS = {"model": "model.type", "position": "model.attention.position.type"}


@functools.cache  # asked once per parametrization and case (a recipe load each family)
def discovered() -> dict[str, tuple[str, tuple[str, ...]]]:
    """FAMILIES plus one case per registered model / attention / ffn / norm / position encoding
    that none of them uses
    (computed once; callers read it and never change it)."""
    families = dict(FAMILIES)
    used = set().union(*(_names(load_recipe(CONFIGS / f, o)) for f, o in FAMILIES.values()))
    for kind in ("model", "attention", "ffn", "norm", "position"):
        for name in registry.names(kind):
            if (kind, name) not in used:
                key = SWAP_KEYS.get(kind, f"model.{kind}.type")
                families[f"{kind}_{name}"] = ("debug.toml", (*DENSE, f"--{key}={name}"))
    return families


def is_looped(family: str) -> bool:
    file, overrides = discovered()[family]
    return load_recipe(CONFIGS / file, overrides).model.type == "looped"


def ac_modes() -> dict[str, tuple[str, ...]]:
    """Every activation_checkpoint choice; selective twice: every N-th block and op-level."""
    field = ParallelismConfig.model_fields["activation_checkpoint"]
    modes = {}
    for mode in typing.get_args(field.annotation):
        flag = f"--parallelism.activation_checkpoint={mode}"
        if mode == "selective":
            modes["selective_every2"] = (flag, "--parallelism.ac_every=2",
                                         "--parallelism.ac_ops=false")
            modes["selective_ops"] = (flag, "--parallelism.ac_ops=true")
        else:
            modes[mode] = (flag,)
    return modes


# The data a step needs instead of TINY's text: pairs (sums, no role markers: 16 tokens fit).
PAIRS = Path(__file__).parent / "pairs"
SUMS = (f"--data.path={PAIRS / 'sums.jsonl'}", f"--data.template={PAIRS / 'plain.jinja'}",
        "--data.eval_fraction=0.2")
STEP_DATA = {"preference": ("--data.type=preference", *SUMS),  # GRPO: 2 answers per sum
             "grpo": ("--data.type=prompts", *SUMS, "--training.step.group_size=2",
                      "--training.step.rollout.max_new_tokens=4", "--rewards.right.field=chosen",
                      "--rewards.right.type=exact_match", "--rewards.right.extract=all")}


def recipe_for(family: str, folder, *extra: str, step: str = ""):
    """``family``'s recipe at toy size; ``step``: with the data that step trains on."""
    file, overrides = discovered()[family]
    tiny = [o for o in TINY if not o.startswith("--data.")] if step in STEP_DATA else TINY
    return load_recipe(CONFIGS / file, [*tiny, *overrides, f"--run.folder={folder}",
                                        *STEP_DATA.get(step, ()), *extra])


class Record:
    """A trainer hook keeping every step's loss and whether it was skipped."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.skipped: list[bool] = []

    def on_step_end(self, trainer, result) -> None:
        self.losses.append(result.loss)
        self.skipped.append(result.skipped)


def train(recipe, *, eval_first: bool = False, out=None) -> tuple[list[float], object]:
    from kiln.recipes.hooks.evaluate import evaluate
    from kiln.recipes.training.trainer import Trainer

    record = Record()
    with open(os.devnull, "w") as sink:
        trainer = Trainer(recipe, hooks=[record], out=out or sink)
        if eval_first:
            assert math.isfinite(evaluate(trainer, recipe.eval.tokens))
        trainer.fit()
    return record.losses, trainer


def steps_for(family: str) -> list[str]:
    """Every registered step; segmented BPTT only where the model loops."""
    return [name for name in registry.names("step")
            if name != "segmented_bptt" or is_looped(family)]


def cases():
    """Every (family, step, float8, checkpointing mode) once; evaluating first in half the modes,
    the other half under float8: each (family, step), (float8, mode), (mode, evaluation) pair
    runs (a full cross doubled the matrix). GRPO has no held-out loss."""
    for family in discovered():
        for step in steps_for(family):
            for f, float8 in enumerate(("off", "rowwise")):
                for a, ac in enumerate(ac_modes()):
                    eval_first = step != "grpo" and (a + f) % 2 == 1
                    yield pytest.param(family, step, float8, ac, eval_first,
                                       id=f"{family}-{step}-f8_{float8}-{ac}-"
                                          f"{'eval_first' if eval_first else 'train_first'}")


_reference: dict[tuple, list[float]] = {}
# A matrix cell's batch: 2 micro-batches of 16 tokens (still 2 accumulated, float8's 16-wide
# minimum); half the time of TINY's 2 x 64 on the float8 and looped cells.
CELL = ("--training.seq_len=16", "--training.global_batch=2", "--training.micro_batch=1")


def _run(tmp_path, family, step, float8, ac, eval_first, *extra: str) -> list[float]:
    from kiln.components.ffn import moe_dispatch

    moe_dispatch.grouped_mm_works.cache_clear()  # decided afresh in every case
    args = [*CELL, *ac_modes()[ac], f"--parallelism.float8={float8}",
            f"--training.step.type={step}", *extra]
    if step == "segmented_bptt":
        args.append("--training.step.segment_loops=1")
    losses, trainer = train(recipe_for(family, tmp_path / "run", *args, step=step),
                            eval_first=eval_first)
    if float8 != "off":
        assert trainer.parallel.float8_modules, "float8 converted no layer: the case is vacuous"
    return losses


@pytest.mark.matrix
@pytest.mark.parametrize("family, step, float8, ac, eval_first", list(cases()))
def test_every_combination_trains(tmp_path, family, step, float8, ac, eval_first):
    """2 optimizer steps, finite; and the same losses as the same recipe without activation
    checkpointing and without the evaluation first (recomputation and a no_grad evaluation must
    not change training): one reference run per (family, step, float8). The cell that is the
    reference's configuration (no checkpointing, training first: the first of its float8 setting
    without float8) is the reference, so each other cell is also a second run that must agree."""
    losses = _run(tmp_path, family, step, float8, ac, eval_first)
    assert len(losses) == STEPS and all(map(math.isfinite, losses)), losses
    key = (family, step, float8)
    if key not in _reference:
        _reference[key] = losses if (ac, eval_first) == ("none", False) else \
            _run(tmp_path / "ref", family, step, float8, "none", False)
    assert losses == _reference[key]


DOC_MASK = ("--model.attention.document_mask=true", "--model.attention.positions=per_document")


@pytest.mark.matrix
@pytest.mark.parametrize("family, step, ac", [
    pytest.param(f, s, ac, id=f"{f}-{s}-{ac}") for f in discovered() for s in steps_for(f)
    for ac in ("none", "full", "selective_ops")])
def test_document_mask_in_every_family_step_and_checkpointing_mode(tmp_path, family, step, ac):
    """``model.attention.document_mask`` (per-document positions) with float8: finite, and
    activation checkpointing recomputes the masked attention exactly."""
    args = [*CELL, *DOC_MASK, "--parallelism.float8=rowwise", f"--training.step.type={step}"]
    if step == "segmented_bptt":
        args.append("--training.step.segment_loops=1")
    losses, trainer = train(recipe_for(family, tmp_path / "run", *args, *ac_modes()[ac],
                                       step=step))
    assert len(losses) == STEPS and all(map(math.isfinite, losses)), losses
    assert trainer.model_inputs.document_mask
    key = ("document_mask", family, step)  # the "none" cell, run first, is the reference
    if key not in _reference:  # (a -k selection without it trains it here)
        _reference[key] = losses if ac == "none" else \
            train(recipe_for(family, tmp_path / "ref", *args, step=step))[0]
    assert losses == _reference[key]


DIAGNOSTICS = ("--run.diagnostics.interval=1", "--run.diagnostics.histograms=true",
               "--run.tensorboard=true")


@pytest.mark.matrix
@pytest.mark.parametrize("family, step", [(f, s) for f in discovered() for s in steps_for(f)])
def test_diagnostics_change_no_loss_in_any_family(tmp_path, family, step):
    """Module diagnostics on every step, under full activation checkpointing (whose recompute
    must not see the hooks' work): the same losses as the reference without either, and a
    diagnostics line per step."""
    losses = _run(tmp_path, family, step, "off", "full", False, *DIAGNOSTICS)
    key = (family, step, "off")
    if key not in _reference:
        _reference[key] = _run(tmp_path / "ref", family, step, "off", "none", False)
    assert losses == _reference[key]
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if "diag/act/layer0/rms" in x] == list(range(1, STEPS + 1))


def test_the_matrix_covers_what_kiln_ships():
    """Every model family of the brief, every registered model/attention/ffn, every AC mode."""
    families = discovered()
    names = set().union(*(_names(load_recipe(CONFIGS / f, o)) for f, o in families.values()))
    for kind in ("model", "attention", "ffn"):
        assert {(kind, n) for n in registry.names(kind)} <= names, kind
    assert set(ac_modes()) == {"none", "full", "selective_every2", "selective_ops"}
    looped = [f for f in families if is_looped(f)]
    assert looped and all("segmented_bptt" in steps_for(f) for f in looped)
    nova = load_recipe(CONFIGS / families["diff_layerscale"][0], families["diff_layerscale"][1])
    assert nova.model.attention.type == "differential" and nova.model.layerscale_init > 0
    assert nova.model.parametrization == "mup" and nova.model.dim == 2 * nova.model.base_dim


CHUNK = "--training.loss_chunk_tokens=24"  # 64 tokens per micro-batch: 3 chunks, one short


@pytest.mark.matrix
@pytest.mark.parametrize("family", list(discovered()))
def test_chunked_loss_equals_unchunked_in_every_family(family, tmp_path):
    plain, _ = train(recipe_for(family, tmp_path / "plain"))
    chunked, _ = train(recipe_for(family, tmp_path / "chunked", CHUNK))
    assert abs(chunked[0] - plain[0]) < 1e-6, family  # the same weights: the same loss
    assert chunked == pytest.approx(plain, rel=1e-5), family


@pytest.mark.matrix
@pytest.mark.parametrize("family", list(discovered()))
def test_downstream_tasks_leave_training_unchanged_in_every_family(family, tmp_path):
    """[evals.NAME] every step (multiple choice, exact match, bits per byte): the same losses."""
    from tests.recipes.hooks.test_downstream import task_flags

    plain, _ = train(recipe_for(family, tmp_path / "plain"))
    scored, _ = train(recipe_for(family, tmp_path / "evals", *task_flags(tmp_path, interval=1)))
    assert scored == plain, family

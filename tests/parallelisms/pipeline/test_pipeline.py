"""Pipeline parallelism, single process: the split, the stage contract, the schedules' checks
and bubble, the recipe errors (from ``kiln validate`` and from ``parallelize``, which ``kiln
train`` calls), the merged checkpoint JSON. The multi-process runs are in
``test_pipeline_dist.py``."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.checkpointing import rank_json
from kiln.components.errors import RecipeError
from kiln.parallelisms.config import ParallelismConfig
from kiln.parallelisms.layout.mesh import MESH_DIMS, layout
from kiln.parallelisms.pipeline.checks import pipeline_problems
from kiln.parallelisms.pipeline.schedule import bubble_fraction, microbatch_problem
from kiln.parallelisms.pipeline.split import (
    StageCosts,
    balanced_split,
    rank_stages,
    split_problems,
    stage_rank,
)
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS
from tests.parallelisms.tiny import VOCAB, tiny_model


def pp(**kw) -> ParallelismConfig:
    return ParallelismConfig(pp=2, **kw)


def test_the_mesh_puts_pp_outermost():
    shape = layout(ParallelismConfig(pp=2, dp_shard=2), 4)
    assert MESH_DIMS[0] == "pp" and shape.shape == (2, 1, 2, 1, 1)
    assert [shape.pp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [shape.dp_rank(r) for r in range(4)] == [0, 1, 0, 1]  # stage peers share rows
    assert shape.describe() == "pp 2 x dp_replicate 1 x dp_shard 2 x tp 1 = 4 ranks"
    assert layout(ParallelismConfig(), 2).describe().startswith("dp_replicate 1")  # pp 1: unsaid
    with pytest.raises(RecipeError, match="parallelism.pp = 3 does not divide the world size 4"):
        layout(ParallelismConfig(pp=3), 4)


def test_stages_sit_on_ranks_in_a_loop_or_a_v():
    loop, v = pp(pp_schedule="interleaved_1f1b"), pp(pp_schedule="zbv_zero_bubble")
    assert [stage_rank(loop, s) for s in range(4)] == [0, 1, 0, 1]
    assert [stage_rank(v, s) for s in range(4)] == [0, 1, 1, 0]
    assert rank_stages(v, 0) == [0, 3] and rank_stages(pp(), 1) == [1]


def test_balanced_split_evens_out_the_costs_with_the_head_on_the_last_stage():
    assert balanced_split(StageCosts([1.0] * 4, 0.0, 0.0), 2) == [2, 2]
    assert balanced_split(StageCosts([1.0] * 4, 0.0, 2.0), 2) == [3, 1]  # a heavy head
    assert balanced_split(StageCosts([1.0] * 6, 0.0, 0.0), 4) in ([2, 2, 1, 1], [2, 1, 2, 1],
                                                                  [1, 2, 2, 1], [2, 1, 1, 2])
    assert sum(balanced_split(StageCosts([3.0, 1.0, 1.0, 1.0, 1.0], 0.0, 0.0), 3)) == 5


def test_split_problems_name_the_keys():
    (msg,) = split_problems(ParallelismConfig(pp=4), 3)
    assert "parallelism.pp = 4" in msg and "3 layers (model.n_layers)" in msg
    (msg,) = split_problems(pp(pp_split=[1, 1]), 3)
    assert "parallelism.pp_split = [1, 1] does not cover the model's 3 layers" in msg
    (msg,) = split_problems(pp(pp_split=[3]), 3)
    assert "1 entries" in msg and "makes 2 stages" in msg
    assert split_problems(pp(pp_split=[1, 2]), 3) == []


def test_bubble_is_the_textbook_fraction():
    """(p - 1) / (m + p - 1) for GPipe and 1F1B, (p - 1) / (v m + p - 1) interleaved, and the
    zero-bubble schedules below them (their backward split in input and weight halves)."""
    for m in (2, 4, 8):
        assert bubble_fraction(pp(pp_schedule="gpipe"), m) == pytest.approx(1 / (m + 1))
        assert bubble_fraction(pp(), m) == pytest.approx(1 / (m + 1))
        assert bubble_fraction(pp(pp_schedule="interleaved_1f1b"), m) == pytest.approx(
            1 / (2 * m + 1))
        zb = bubble_fraction(pp(pp_schedule="interleaved_zero_bubble"), m)
        assert zb < bubble_fraction(pp(pp_schedule="interleaved_1f1b"), m)
    assert bubble_fraction(ParallelismConfig(pp=4), 4) == pytest.approx(3 / 7)


def test_micro_batch_counts_are_checked_by_torchs_own_schedules():
    assert microbatch_problem(pp(pp_schedule="gpipe"), 1) is None
    msg = microbatch_problem(pp(), 1)
    assert "cannot run 1 micro-batches" in msg and "training.micro_batch" in msg
    assert "at least pp = 2" in microbatch_problem(pp(pp_schedule="interleaved_1f1b"), 1)
    assert microbatch_problem(pp(pp_schedule="dualpipev"), 2) is not None  # needs 4 (stages)
    assert microbatch_problem(pp(pp_schedule="dualpipev"), 4) is None


def _recipe(*extra: str):
    return load_recipe(CONFIGS / "debug.toml", list(extra))


@pytest.mark.parametrize("extra, wanted", [
    (("--parallelism.pp=2", "--model.n_layers=1"), "needs 2 stages of at least one layer"),
    (("--parallelism.pp=2", "--parallelism.pp_split=[1,2]"), "does not cover the model's 4"),
    (("--parallelism.pp=2", "--training.micro_batch=8"), "cannot run 1 micro-batches"),
    (("--parallelism.pp=2", "--parallelism.pp_microbatches=3"),
     "parallelism.pp_microbatches = 3 does not divide the 2 micro-batches"),
    (("--parallelism.pp=2", "--parallelism.compile=true",
      "--parallelism.pp_schedule=interleaved_zero_bubble"), "compile = true with pp_schedule"),
    (("--parallelism.pp=2", "--checkpoint.export_at_end=true"), "checkpoint.export_at_end"),
    (("--parallelism.pp=2", "--model.attention.document_mask=true"),
     "model.attention.document_mask = true with parallelism.pp = 2"),
])
def test_kiln_validate_refuses_bad_pipelines_naming_the_keys(extra, wanted, capsys):
    from kiln.recipes.cli import main

    assert main(["validate", str(CONFIGS / "debug.toml"), "--world-size", "2", *extra]) == 2
    out = capsys.readouterr().out
    assert "INVALID" in out and wanted in out, out


def test_looped_models_and_segmented_steps_are_refused():
    recipe = load_recipe(CONFIGS / "looped_moe_debug.toml", ["--parallelism.pp=2"])
    with torch.device("meta"):
        model = recipe.model.build(vocab_size=VOCAB, seq_len=32)
    (msg,) = pipeline_problems(recipe.parallelism, recipe.training, model, 2)
    assert "looped" in msg.lower() and "set parallelism.pp = 1" in msg
    recipe = _recipe("--parallelism.pp=2", "--training.step.type=segmented_bptt")
    problems = pipeline_problems(recipe.parallelism, recipe.training, tiny_model(meta=True,
                                                                                 n_layers=4), 2)
    assert any("training.step.type = \"segmented_bptt\"" in p for p in problems)


def test_kiln_train_refuses_the_same_through_parallelize():
    """The trainer's refusal comes from ``parallelize`` (run here on a fake 2-rank world)."""
    from kiln.recipes.preflight.layout_plan import dry_parallelize, fake_world

    recipe = _recipe("--parallelism.pp=2", "--parallelism.pp_split=[3,3]")
    with fake_world(2), pytest.raises(RecipeError, match=r"pp_split = \[3, 3\] does not cover"):
        dry_parallelize(tiny_model(meta=True, n_layers=4), recipe.parallelism, 2,
                        training=recipe.training, grad_accum=2)


def test_validate_shows_the_mesh_stage_memory_and_bubble(capsys):
    from kiln.recipes.cli import main

    assert main(["validate", str(CONFIGS / "debug.toml"), "--world-size", "4",
                 "--parallelism.pp=2", "--training.micro_batch=2"]) == 0
    out = capsys.readouterr().out
    assert "mesh pp 2 x dp_replicate 1 x dp_shard 2 x tp 1 = 4 ranks" in out
    assert "pipeline rank 0 (rank 0): stage 0" in out and "pipeline rank 1 (rank 2)" in out
    assert "pipeline bubble: 33.3% of each run idle (1f1b, 2 micro-batches" in out


def _stages(model, counts, first_last_shared=True):
    """Pruned copies of ``model``, one per stage, as ``split_model`` prunes (single process)."""
    keys = list(model.layers.keys())
    out, start = [], 0
    for i, c in enumerate(counts):
        part = copy.deepcopy(model)
        keep = keys[start:start + c]
        for k in keys:
            if k not in keep:
                del part.layers[k]
        first, last = i == 0, i == len(counts) - 1
        if not first and not (last and model.tied):
            part.tok_embeddings = None
        if not last:
            part.norm = part.output = None
        out.append((part, keep, first, last))
        start += c
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_stage_forward_chained_equals_the_whole_forward(tied):
    """The stage contract: pruned copies run one after the other give the model's logits."""
    model = tiny_model(n_layers=4, tie_embeddings=tied).eval()
    ids = torch.randint(0, VOCAB, (2, 16))
    h = ids
    for part, keys, first, last in _stages(model, [1, 2, 1]):
        h = part.stage_forward(h, keys, first=first, last=last)
    assert torch.equal(h, model(ids))


def test_a_pruned_stage_initialises_from_the_whole_model_bit_for_bit():
    from types import SimpleNamespace

    from kiln.parallelisms.meta_init import materialize

    whole = tiny_model(seed=0, n_layers=4)
    torch.manual_seed(5)  # init_weights draws from the seed materialize sets, not this one
    reference = tiny_model(meta=True, n_layers=4)
    reference.to_empty(device="cpu")
    torch.manual_seed(0)
    reference.init_weights()
    meta = tiny_model(meta=True, n_layers=4)
    part, _, _, _ = _stages(meta, [2, 2])[1]
    pipe = SimpleNamespace(skeleton=meta, pp_rank=1)
    assert "equals single-process init" in materialize(part, "cpu", 0, pipeline=pipe)
    want = dict(reference.named_parameters())
    for name, p in part.named_parameters():
        assert torch.equal(p, want[name]), name
    assert pipe.skeleton is None  # dropped after use
    assert sum(1 for _ in part.parameters()) < sum(1 for _ in whole.parameters())


def test_checkpoint_json_of_pipeline_ranks_merges_by_group_name():
    a = {"optimizer": {"main": {"param_groups": [{"name": "decay", "params": ["a", "b"]},
                                                 {"name": "no_decay", "params": ["n0"]}],
                                "state": {"a": {"k": 1}}}}}
    b = {"optimizer": {"main": {"param_groups": [{"name": "decay", "params": ["c", "b"]}],
                                "state": {"c": {"k": 2}}}}}
    merged = rank_json.merge([a, b])["optimizer"]["main"]
    assert merged["param_groups"][0]["params"] == ["a", "b", "c"]
    assert merged["param_groups"][1]["params"] == ["n0"]
    assert merged["state"] == {"a": {"k": 1}, "c": {"k": 2}}
    assert rank_json.merge([a, a]) == a  # identical ranks (FSDP, tp): unchanged
    assert rank_json.own_state(merged["state"], {"c"}) == {"c": {"k": 2}}


def test_in_loop_downstream_evals_are_refused_under_pp():
    from types import SimpleNamespace

    from kiln.recipes.hooks.downstream import DownstreamEvalHook

    trainer = SimpleNamespace(recipe=SimpleNamespace(evals={"mc": object()}),
                              mesh_layout=SimpleNamespace(tp=1, pp=2), model=None,
                              tokenizer=None, world=SimpleNamespace(distributed=False),
                              print=print)
    with pytest.raises(RecipeError, match=r"pipeline parallelism yet \(parallelism.pp = 2\)"):
        DownstreamEvalHook().on_train_start(trainer)


def test_module_diagnostics_are_refused_under_pp():
    from types import SimpleNamespace

    from kiln.recipes.hooks.diagnostics import DiagnosticsHook

    hook = DiagnosticsHook.__new__(DiagnosticsHook)  # its config is not read before the check
    trainer = SimpleNamespace(mesh_layout=SimpleNamespace(tp=1, pp=2))
    with pytest.raises(RecipeError, match=r"\[run.diagnostics\] with parallelism.pp = 2"):
        hook.on_train_start(trainer)

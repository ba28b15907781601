"""The layout planner (issue 14 item 7): `kiln validate RECIPE --world-size N` prints the mesh and
per-rank memory from a dry parallelize on meta, and refuses layouts that do not divide."""

from __future__ import annotations

import re

import pytest

from kiln.recipes.cli import main
from kiln.recipes.config.files import load_recipe
from kiln.recipes.loading.meta_model import build_meta_model
from tests.conftest import CONFIGS


def _gib(out: str, what: str) -> float:
    value, unit = re.search(rf"{what} +([0-9.,]+) (GiB|MiB)", out).groups()
    return float(value.replace(",", "")) / (1 if unit == "GiB" else 1024)


def test_validate_plans_tensor_parallel_memory_per_rank(capsys, monkeypatch):
    monkeypatch.delenv("NGPU", raising=False)
    args = ["validate", str(CONFIGS / "debug.toml"), "--world-size", "4", "--parallelism.tp=2"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "mesh dp_replicate 1 x dp_shard 2 x tp 2 = 4 ranks" in out
    assert "tensor parallel 2" in out and "FSDP2 over 2 ranks" in out
    total = build_meta_model(load_recipe(CONFIGS / "debug.toml")).num_params() * 4 / 2**30
    # 4 ranks hold a quarter each (rank 0 a little more: the padded FSDP2 shards)
    assert total / 4 * 0.999 <= _gib(out, "parameters") <= total / 4 * 1.1
    assert _gib(out, "gradients") == _gib(out, "parameters")
    # AdamW: two fp32 moments per element, measured on a probe step
    assert _gib(out, "optimizer state") == pytest.approx(2 * _gib(out, "parameters"), rel=0.02)
    assert "loss_chunk_tokens" not in out
    assert main([*args, "--training.loss_chunk_tokens=256"]) == 0  # not used under tp: a note
    assert "note: training.loss_chunk_tokens = 256 not used with parallelism.tp = 2" in (
        capsys.readouterr().out)


def test_validate_plans_expert_parallel(capsys, monkeypatch):
    monkeypatch.delenv("NGPU", raising=False)
    moe = str(CONFIGS / "looped_moe_debug.toml")
    assert main(["validate", moe, "--world-size", "4", "--parallelism.ep=4",
                 "--training.micro_batch=2"]) == 0
    out = capsys.readouterr().out
    assert "expert parallel 4" in out and "experts over ep 4" in out
    assert main(["validate", moe, "--world-size", "4", "--parallelism.ep=4",
                 "--training.micro_batch=2", "--model.ffn.n_experts=6"]) == 2
    assert "model.ffn.n_experts = 6 is not divisible by parallelism.ep = 4" in (
        capsys.readouterr().out)


@pytest.mark.parametrize(("world", "flags", "message"), [
    (6, ["--parallelism.tp=3", "--training.seq_len=96"],
     "model.attention.n_heads = 8 is not divisible by parallelism.tp"),
    (4, ["--parallelism.tp=3"], "parallelism.tp = 3 does not divide the world size 4"),
    (2, ["--parallelism.ep=2"], "parallelism.ep = 2 needs MoE layers"),
    (4, ["--parallelism.tp=2", "--training.seq_len=33"],
     "training.seq_len = 33 (sequence-parallel slices) is not divisible by parallelism.tp = 2"),
])
def test_validate_refuses_layouts_that_do_not_divide(capsys, monkeypatch, world, flags, message):
    monkeypatch.delenv("NGPU", raising=False)
    args = ["validate", str(CONFIGS / "debug.toml"), "--world-size", str(world), *flags]
    assert main(args) == 2
    out = capsys.readouterr().out
    assert "INVALID" in out and message in out


@pytest.mark.parametrize("extra", [(), ("--model.attention.document_mask=true",),
                                   ("--parallelism.activation_checkpoint=full",)],
                         ids=["causal", "document_mask", "full_ac"])
def test_activations_measured_on_meta_match_a_real_cpu_forward(extra):
    """`kiln validate`'s activation figure (meta device, the fused kernel spelled out) is what
    the real CPU kernels save for the backward."""
    import torch

    from kiln.components.models.block import padded_vocab
    from kiln.recipes.training.activation_memory import measure

    recipe = load_recipe(CONFIGS / "debug.toml", ["--model.dim=64", "--model.n_layers=2",
                                                   "--training.seq_len=64", *extra])

    def real():
        torch.manual_seed(0)
        return recipe.model.build(vocab_size=padded_vocab(recipe.model, 258), seq_len=64)

    meta, mask = measure(recipe, lambda: build_meta_model(recipe), 1)
    cpu, _ = measure(recipe, real, 1, device="cpu")
    assert meta == pytest.approx(cpu, rel=0.02), (meta, cpu)
    assert (mask > 0) == bool(extra and "document_mask" in extra[0])
    if extra and "activation_checkpoint" in extra[0]:
        assert meta < measure(load_recipe(CONFIGS / "debug.toml", [
            "--model.dim=64", "--model.n_layers=2", "--training.seq_len=64"]),
            lambda: build_meta_model(recipe), 1)[0] / 3


def test_validate_reports_activations_by_context_parallel_degree(capsys, monkeypatch):
    monkeypatch.delenv("NGPU", raising=False)
    args = ["validate", str(CONFIGS / "debug.toml"), "--world-size", "4", "--parallelism.cp=2",
            "--model.attention.document_mask=true"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "mesh dp_replicate 1 x dp_shard 2 x cp 2 x tp 1 = 4 ranks" in out
    by_cp = dict(re.findall(r"cp (\d): ([0-9.,]+) MiB", out))
    assert set(by_cp) == {"1", "2", "4"}
    a1, a2, a4 = (float(by_cp[c].replace(",", "")) for c in "124")
    assert a1 > a2 > a4  # each rank holds 1/cp of the tokens (and every key and value)
    assert _gib(out, "activations") * 1024 == pytest.approx(a2, rel=1e-3)
    assert "of which the dense attention mask" in out

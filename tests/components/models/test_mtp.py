"""Multi-token prediction (DeepSeek-V3): depth k's targets are the tokens k + 1 ahead and its
inputs the embeddings k ahead (checked against the raw row, not the labels); the reported loss
stays the trunk's (the modules add their gradient, logged per depth); a target in another
document is not trained; Hugging Face exports drop the modules and imports leave them at their
init; what cannot hold them says so."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from kiln.components.attention.context import build_context
from kiln.components.models import mtp
from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.parallelisms.layout.check import model_problems
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS

TINY = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4",
        "--model.ffn.hidden_dim=48", "--training.seq_len=16"]


def _model(*extra):
    recipe = load_recipe(CONFIGS / "debug.toml", [*TINY, "--model.mtp_depth=2", *extra])
    torch.manual_seed(0)
    return recipe.model.build(vocab_size=258, seq_len=16)


def test_each_depth_predicts_k_plus_one_ahead_from_the_embeddings_k_ahead():
    model = _model().train()
    raw = torch.randint(0, 258, (2, 13), generator=torch.Generator().manual_seed(0))
    ids, labels = raw[:, :-1], raw[:, 1:]
    model(ids, mtp_labels=labels)
    aux = model.pop_aux_loss()
    depths = model.metrics()
    with torch.no_grad():  # depth by depth from the raw row
        hidden = model.stage_forward(ids, model.layers.keys(), first=True, last=False)
        want = []
        for k, module in enumerate(model.mtp, start=1):
            ahead = torch.zeros_like(ids)
            ahead[:, :12 - k] = raw[:, k:12]
            emb = model.tok_embeddings(ahead)
            emb[:, 12 - k:] = 0
            hidden = module(emb, hidden)
            logits = model.output(module.norm(hidden))[:, :12 - k]
            want.append(F.cross_entropy(logits.flatten(0, 1), raw[:, k + 1:].flatten()))
    assert [depths["mtp/loss_1"], depths["mtp/loss_2"]] == pytest.approx(
        [w.item() for w in want], rel=1e-5)
    assert aux.item() == pytest.approx(0.3 / 2 * sum(w.item() for w in want), rel=1e-5)
    aux.backward()
    for name in ("mtp.0.eh_proj.weight", "mtp.1.block.attention.wq.weight", "tok_embeddings.weight",
                 "layers.0.attention.wq.weight"):
        assert dict(model.named_parameters())[name].grad.abs().sum() > 0, name
    assert model.pop_aux_loss() is None  # popped once
    model.eval()
    model(ids, mtp_labels=labels)
    assert model.pop_aux_loss() is None  # evaluation runs the trunk alone


@pytest.mark.parametrize("ffn", [(), ("--model.ffn.type=moe", "--model.ffn.n_experts=4",
                                       "--model.ffn.top_k=2")], ids=["dense", "moe"])
def test_flops_with_the_trunk_alone_are_the_model_without_the_modules(ffn):
    """What MFU counts under a step that scores the main head (preference, GRPO)."""
    with_mtp = _model(*ffn)
    recipe = load_recipe(CONFIGS / "debug.toml", [*TINY, *ffn])
    plain = recipe.model.build(vocab_size=258, seq_len=16)
    trunk = with_mtp.flops_per_token(16, mtp=False)
    assert trunk == plain.flops_per_token(16) < with_mtp.flops_per_token(16)


def test_a_target_in_another_document_is_not_trained():
    model = _model().train()
    ids = torch.randint(0, 258, (1, 10), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, 1)
    doc_ids = torch.tensor([[0] * 4 + [1] * 6])
    seen = []
    real = mtp.chunked_cross_entropy
    with mock.patch.object(mtp, "chunked_cross_entropy",
                           side_effect=lambda h, w, target, **kw: seen.append(target) or
                           real(h, w, target, **kw)):
        model(ids, mtp_labels=labels, context=build_context(10, doc_ids=doc_ids))
    first = seen[0][0]  # depth 1: position i needs the input at i + 1 in its document
    assert (first[[3, 9]] == IGNORE_INDEX).all() and (first[:3] == labels[0, 1:4]).all()
    assert (first[4:9] == labels[0, 5:10]).all()
    assert (seen[1][0][[2, 3, 8, 9]] == IGNORE_INDEX).all()  # depth 2: two ahead


def test_training_reports_the_trunk_loss_and_logs_each_depth(tmp_path):
    from kiln.recipes.training.trainer import Trainer

    losses = {}
    for depth in (0, 1):
        folder = tmp_path / f"mtp{depth}"
        recipe = load_recipe(CONFIGS / "debug.toml", [
            *TINY, f"--model.mtp_depth={depth}", "--training.steps=2", "--run.log_interval=1",
            "--training.global_batch=2", "--training.micro_batch=1", "--eval.interval=0",
            "--eval.at_end=false", "--checkpoint.enable=false", f"--run.folder={folder}",
            "--data.max_bytes=100000", "--run.progress_bar=false", "--run.tensorboard=false"])
        with open("/dev/null", "w") as sink:
            Trainer(recipe, out=sink).fit()
        rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        losses[depth] = [r["loss"] for r in rows if "loss" in r]
        if depth:
            assert all(r["mtp/loss_1"] > 0 for r in rows if "loss" in r)
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-6)  # same trunk, same first loss
    assert losses[1][1] != pytest.approx(losses[0][1], rel=1e-6)  # the modules' gradient


def test_hugging_face_export_drops_the_modules_and_import_keeps_their_init(tmp_path):
    from kiln.checkpointing.huggingface import export
    from kiln.checkpointing.huggingface import importer as hf_import

    model = _model().eval()
    summary = export.export(model, None, tmp_path / "hf", model_table={}, recipe_file=None)
    assert summary["layout"] == "hf"
    fresh = _model("--training.seed=1")
    before = fresh.mtp[0].eh_proj.weight.clone()
    hf_import.load_weights(fresh, tmp_path / "hf", hf_import.read_config(tmp_path / "hf"))
    assert torch.equal(fresh.output.weight, model.output.weight)
    assert torch.equal(fresh.mtp[0].eh_proj.weight, before)
    kiln = export.export(model, None, tmp_path / "kiln", model_table={}, recipe_file=None,
                         fmt="kiln")
    assert kiln["layout"] == "kiln"
    for folder, kept in (("hf", False), ("kiln", True)):
        with safe_open(str(tmp_path / folder / "model.safetensors"), framework="pt") as f:
            names = list(f.keys())  # noqa: SIM118 (a safe_open handle is not a dict)
        assert any(n.startswith("mtp.") for n in names) == kept, folder


def test_what_cannot_hold_the_modules_says_so():
    model = _model()
    for kw in ({"tp": 2}, {"tp": 1, "ep": 2}, {"tp": 1, "cp": 2}):
        assert any("model.mtp_depth cannot run" in p for p in model_problems(model, **kw)), kw


def test_mup_scales_the_modules_blocks_as_the_trunks():
    model = _model("--model.dim=64", "--model.parametrization=mup", "--model.base_dim=32",
                   "--model.base_head_dim=8", "--optimizer.type=adamw")
    trunk, module = model.blocks()[0].attention, model.mtp[0].block.attention
    assert module.q_scale == trunk.q_scale == pytest.approx((8 / 16) ** 0.5)
    multipliers = model.lr_multipliers()
    assert multipliers["mtp.0.eh_proj.weight"] == multipliers["layers.0.attention.wq.weight"]

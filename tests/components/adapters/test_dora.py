"""DoRA, the second adapter type: it starts from the base exactly, its logits and gradients
equal peft's ``use_dora`` on the exported base with its exported adapter, the merged export
computes the same function, and a run from ``init_from`` takes its magnitudes from the loaded
base, checkpoints its adapters alone and exports them without the base's weights."""

from __future__ import annotations

import io
import json
import shutil

import pytest
import torch

from kiln.components.adapters.dora import DoRA, DoRAConfig
from kiln.components.errors import CheckpointError
from kiln.components.models.block import padded_vocab
from kiln.components.models.lm_head import LossHead
from kiln.recipes.cli import main
from kiln.recipes.config.files import load_recipe
from kiln.recipes.inference.saved_model import export_checkpoint
from tests.components.adapters.test_lora import (
    TINY,
    _grads,
    _ids,
    _kiln_logits,
    _save,
    assert_chunked_head_equals_plain,
    assert_peft_equals_kiln,
)
from tests.conftest import CONFIGS

TARGETS = '--adapter.targets=["output", "*.attention.wq", "*.attention.wk", "*.feed_forward.w2"]'


def _perturb_adapters(model, seed=0):
    """Random B and magnitudes, so the adapters change the function and a check can fail."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("dora.B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("dora.magnitude"):
                p.mul_(1 + 0.3 * torch.rand(p.shape, generator=g))


@pytest.fixture(scope="module")
def dora(tmp_path_factory):
    """(the base as a Hugging Face folder, a DoRA checkpoint on it, the kiln model)."""
    root = tmp_path_factory.mktemp("dora")
    base_recipe = load_recipe(CONFIGS / "debug.toml", TINY)
    torch.manual_seed(0)
    model = base_recipe.model.build(vocab_size=padded_vocab(base_recipe.model, 258), seq_len=16)
    export_checkpoint(_save(root / "base", model, base_recipe), root / "hf")
    recipe = load_recipe(CONFIGS / "debug.toml", [
        *TINY, "--adapter.type=dora", "--adapter.rank=4", "--adapter.alpha=12", TARGETS,
        f"--checkpoint.init_from={root / 'hf'}"])
    recipe.adapter.build().apply(model)
    _perturb_adapters(model)
    return root / "hf", _save(root / "dora", model, recipe), model


def test_dora_starts_from_the_base_exactly_and_trains_only_its_own_parameters():
    recipe = load_recipe(CONFIGS / "debug.toml", TINY)
    model = recipe.model.build(vocab_size=264, seq_len=16)
    before = _kiln_logits(model)
    line = DoRA(DoRAConfig(type="dora", rank=2, targets=["*.attention.wq", "output"])).apply(model)
    assert "dora rank 2" in line and "on 3 layers" in line
    torch.testing.assert_close(_kiln_logits(model), before, rtol=0, atol=1e-6)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{layer}.dora.{p}" for layer in
                         ["layers.0.attention.wq", "layers.1.attention.wq", "output"]
                         for p in ("A", "B", "magnitude")}
    wq = model.get_submodule("layers.0.attention.wq")
    torch.testing.assert_close(wq.dora.magnitude, wq.weight.norm(dim=1))


def test_a_meta_device_build_gets_its_magnitudes_from_the_initialised_base():
    from kiln.parallelisms.meta_init import _init_weights

    recipe = load_recipe(CONFIGS / "debug.toml", TINY)
    with torch.device("meta"):
        model = recipe.model.build(vocab_size=264, seq_len=16)
        DoRA(DoRAConfig(type="dora", rank=2)).apply(model)
    model = model.to_empty(device="cpu")
    _init_weights(model)
    wk = model.get_submodule("layers.1.attention.wk")
    torch.testing.assert_close(wk.dora.magnitude, wk.weight.norm(dim=1))
    assert not wk.dora.B.any()


def test_peft_loads_the_dora_export_and_its_logits_equal_kilns(dora, tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_base, checkpoint, model = dora
    assert main(["export", str(checkpoint), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["use_dora"] is True and config["r"] == 4 and config["lora_alpha"] == 12
    assert_peft_equals_kiln(hf_base, tmp_path / "adapter", model)
    ours = _kiln_logits(model)
    summary = export_checkpoint(checkpoint, tmp_path / "merged")  # merged: the same function
    assert summary["layout"] == "hf"
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                               dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(_ids()).logits, ours, rtol=1e-5, atol=1e-5)


def test_dora_gradients_under_the_chunked_loss_equal_peft(dora, tmp_path):
    """On the output layer the chunked loss widens the head with DoRA's columns: its loss and
    gradients (magnitudes included) equal peft's, whose head is unchunked."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    hf_base, checkpoint, model = dora
    export_checkpoint(checkpoint, tmp_path / "adapter", fmt="peft")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_base, dtype=torch.float32)
    theirs_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    ids = _ids()
    theirs_loss = theirs_model(input_ids=ids, labels=ids).loss
    theirs_loss.backward()
    theirs = {n: p.grad for n, p in theirs_model.named_parameters() if p.requires_grad}
    model.train()
    ours_loss, ours = _grads(model, lambda m: m(ids[:, :-1], head=LossHead(ids[:, 1:], 5)))
    torch.testing.assert_close(ours_loss, theirs_loss.detach(), rtol=1e-5, atol=1e-6)
    pairs = [("output.dora.B", "lm_head.lora_B.default.weight"),
             ("output.dora.magnitude", "lm_head.lora_magnitude_vector.default.weight"),
             ("layers.0.feed_forward.w2.dora.A", "layers.0.mlp.down_proj.lora_A.default.weight"),
             ("layers.1.feed_forward.w2.dora.magnitude",
              "layers.1.mlp.down_proj.lora_magnitude_vector.default.weight")]
    for kiln_name, peft_name in pairs:
        got = next(g for n, g in theirs.items() if n.endswith(peft_name))
        assert got.abs().sum() > 0
        torch.testing.assert_close(ours[kiln_name], got, rtol=1e-4, atol=1e-6)


def test_a_dora_run_from_init_from_saves_its_adapters_and_exports_them_without_the_base(
        dora, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    from kiln.recipes.training.trainer import Trainer

    hf_base = shutil.copytree(dora[0], tmp_path / "base")
    recipe = load_recipe(CONFIGS / "debug.toml", [
        *TINY, "--adapter.type=dora", "--adapter.rank=2", TARGETS, "--training.steps=2",
        "--training.global_batch=2", "--training.micro_batch=2", "--checkpoint.interval=2",
        f"--checkpoint.init_from={hf_base}", f"--run.folder={tmp_path / 'run'}",
        "--run.tensorboard=false", "--run.progress_bar=false", "--eval.interval=0"])
    trainer = Trainer(recipe, out=io.StringIO())
    trainer._start_from_pretrained()  # the magnitudes follow the loaded base, not the random one
    output = trainer.model.get_submodule("output")
    torch.testing.assert_close(output.dora.magnitude, output.weight.norm(dim=1))
    trainer.fit()
    ck = tmp_path / "run" / "checkpoints" / "step_0000002"
    saved = [k for k in FileSystemReader(str(ck)).read_metadata().state_dict_metadata
             if k.startswith("model.")]
    assert saved and all(".dora." in k for k in saved)  # adapters only: the base is init_from's
    shutil.rmtree(hf_base)  # --format peft reads the adapters alone
    export_checkpoint(ck, tmp_path / "adapter", fmt="peft")
    names = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert names["base_model_name_or_path"] == str(hf_base) and names["use_dora"]
    with pytest.raises(CheckpointError, match="init_from = .*: no such folder"):  # merging reads it
        export_checkpoint(ck, tmp_path / "merged")


@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_the_chunked_head_equals_the_unchunked_one_with_dora_on_the_output(dropout):
    """DoRA's head columns under the chunked loss: the loss and every gradient of the plain
    head, with dropout drawn once per forward on either path."""
    from tests.recipes.test_combinations import FAMILIES

    file, overrides = FAMILIES["dense"]
    recipe = load_recipe(CONFIGS / file, [*overrides, "--training.seq_len=16",
                                          "--model.tie_embeddings=false"])
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=264, seq_len=16)
    DoRA(DoRAConfig(type="dora", rank=4, dropout=dropout,
                    targets=["output", "*.attention.wq"])).apply(model)
    _perturb_adapters(model)
    model.train()
    grads = assert_chunked_head_equals_plain(model)
    assert grads["output.dora.magnitude"].abs().sum() > 0


def test_switched_off_dora_computes_the_base(dora):
    _, _, model = dora
    adapter = DoRA(DoRAConfig(type="dora"))
    with adapter.disabled(model):
        off = _kiln_logits(model)
    on = _kiln_logits(model)
    base = load_recipe(CONFIGS / "debug.toml", TINY)
    torch.manual_seed(0)
    plain = base.model.build(vocab_size=padded_vocab(base.model, 258), seq_len=16)
    torch.testing.assert_close(off, _kiln_logits(plain))
    assert not torch.allclose(on, off, atol=1e-3)


def test_dropped_base_term_on_a_router_is_computed_in_its_fp32():
    """A bf16 router computes fp32 logits; with adapter dropout DoRA recomputes the base term on
    the dropped input, and does it in the logits' fp32 (as the router does), not in bf16."""
    from kiln.components.ffn.moe import Router

    torch.manual_seed(0)
    router = Router(64, 8, bias=False).to(torch.bfloat16)
    layer = DoRA(DoRAConfig(type="dora", rank=4, dropout=0.5)).layer(router)
    with torch.no_grad():
        layer.B.normal_()
    x = torch.randn(32, 64).to(torch.bfloat16)
    out = router(x)
    assert out.dtype == torch.float32
    torch.manual_seed(1)
    got = layer.train().adapt(router, x, out)
    torch.manual_seed(1)
    xd = layer.dropout(x)
    ratio = layer._ratio(router.weight).float()
    update = (xd @ layer.A.t() @ layer.B.t()) * layer.scale
    want = out + (ratio - 1) * (xd.float() @ router.weight.float().t()) + ratio * update
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

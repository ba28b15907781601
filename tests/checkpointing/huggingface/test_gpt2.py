"""GPT-2 in and out of Hugging Face's layout: `kiln import` of a tiny random ``GPT2LMHeadModel``
(transformers' save, and OpenAI's own form: names without ``transformer.``, causal-mask buffers)
gives its logits and gradients; `kiln export` of a kiln GPT-2 loads in transformers with the
same logits (tied and untied, gelu and relu, its dropouts in the config); what GPT-2's config
cannot say is one clear error naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kiln.checkpointing.huggingface.layout import hf_incompatibility
from kiln.components.errors import CheckpointError
from kiln.recipes.inference.saved_model import export_checkpoint as export
from kiln.recipes.loading.checkpoint_model import load_model
from tests.checkpointing.huggingface.hf_tiny import ids, kiln_from_hf, kiln_model
from tests.checkpointing.huggingface.test_export import checkpoint

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=300, n_positions=64, n_embd=32, n_layer=2, n_head=4,
              bos_token_id=256, eos_token_id=257)


def _gpt2(folder, seed: int = 0, **overrides):
    config = transformers.GPT2Config(**{**CONFIG, **overrides})
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # norms and biases away from ones / zeros: each mapping matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder, max_shard_size="60KB")
    return model


@pytest.mark.parametrize("overrides", [{}, {"activation_function": "relu", "n_inner": 48,
                                            "tie_word_embeddings": False}],
                         ids=["gpt2", "relu_untied"])
def test_imported_gpt2_gives_transformers_logits_and_gradients(tmp_path, overrides):
    hf = _gpt2(tmp_path / "hf", **overrides)
    model = kiln_from_hf(tmp_path / "hf", 32)
    x = ids(t=24)
    ours, theirs = model(x), hf(x).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    ours.logsumexp(-1).sum().backward()
    theirs.logsumexp(-1).sum().backward()
    got = model.layers["1"].attention.wk.weight.grad
    want = hf.transformer.h[1].attn.c_attn.weight.grad[:, 32:64].t()
    assert want.abs().sum() > 0
    assert (got - want).norm() <= 1e-5 * want.norm()


def test_the_imported_recipe_says_gpt2(tmp_path):
    _gpt2(tmp_path / "hf", attn_pdrop=0.0, resid_pdrop=0.2, embd_pdrop=0.2)
    model = kiln_model(tmp_path / "hf", 32)
    recipe = (tmp_path / "hf.toml").read_text()
    assert 'type = "layernorm"' in recipe and 'activation = "gelu_tanh"' in recipe
    assert "seq_len = 64" in recipe  # n_positions, not 2048
    assert model.pos_embeddings is not None and model.max_seq_len == 64
    assert model.embed_dropout.p == 0.2 and model.blocks()[0].attention.dropout_p == 0.0
    assert hf_incompatibility(model) == ""


def test_openais_own_form_imports_too(tmp_path):
    """The gpt2 checkpoints on the Hub: no ``transformer.`` prefix, each layer's causal mask
    stored as ``h.N.attn.bias``."""
    hf = _gpt2(tmp_path / "hf")
    own = tmp_path / "own"
    own.mkdir()
    state = {k.removeprefix("transformer."): v.contiguous() for k, v in hf.state_dict().items()
             if k != "lm_head.weight"}
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 64, 64))
    save_file(state, own / "model.safetensors")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (own / "config.json").write_text(json.dumps({**config, "n_ctx": 64}))
    model = kiln_from_hf(own, 32)
    x = ids(t=16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)


GPT2 = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4",
        "--model.attention.bias=true", "--model.attention.position.type=none",
        "--model.absolute_positions=true", "--model.max_seq_len=16",
        "--model.norm.type=layernorm", "--model.ffn.type=mlp", "--model.ffn.bias=true",
        "--model.ffn.hidden_dim=64", "--training.seq_len=16"]


@pytest.mark.parametrize("extra", [
    ["--model.ffn.activation=gelu_tanh", "--model.tie_embeddings=true", "--model.dropout=0.1",
     "--model.attention.dropout=0.05"],
    ["--model.ffn.activation=relu", "--model.tie_embeddings=false"]],
    ids=["gelu_tied", "relu_untied"])
def test_transformers_loads_the_gpt2_export_with_the_same_logits(tmp_path, extra):
    folder, _ = checkpoint(tmp_path, *extra, tiny=GPT2)
    summary = export(folder, tmp_path / "hf")
    assert summary["layout"] == "hf" and summary["family"] == "gpt2", summary
    _, _, model = load_model(folder)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                           dtype=torch.float32).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    if "--model.dropout=0.1" in extra:
        assert (config["resid_pdrop"], config["embd_pdrop"], config["attn_pdrop"]) == (
            0.1, 0.1, 0.05)
    x = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model.eval()(x), rtol=0, atol=1e-5)


def test_what_gpt2_cannot_say_is_named(tmp_path):
    _gpt2(tmp_path / "hf", activation_function="swish")
    with pytest.raises(CheckpointError, match="'activation_function': 'swish' is not supported"):
        kiln_model(tmp_path / "hf", 32)
    _gpt2(tmp_path / "drop", resid_pdrop=0.1, embd_pdrop=0.0)
    with pytest.raises(CheckpointError, match="'embd_pdrop': 0.0 differs from resid_pdrop"):
        kiln_model(tmp_path / "drop", 32)
    _gpt2(tmp_path / "layer_idx", scale_attn_by_inverse_layer_idx=True)
    with pytest.raises(CheckpointError, match="scale_attn_by_inverse_layer_idx"):
        kiln_model(tmp_path / "layer_idx", 32)
    folder, _ = checkpoint(tmp_path / "gqa", "--model.attention.n_kv_heads=2", tiny=GPT2)
    assert export(folder, tmp_path / "gqa_out")["why_not_hf"].startswith(
        "GPT-2 layout: grouped-query heads")


@pytest.mark.parametrize("kind, extra", [
    ("lora", ["--model.tie_embeddings=false"]), ("dora", ["--model.tie_embeddings=true"])])
def test_a_peft_export_on_gpt2s_conv1d_layers_loads_in_peft_with_kilns_logits(
        tmp_path, kind, extra):
    """Adapters on c_proj, c_fc and mlp.c_proj (Conv1D: weights stored transposed), and on the
    untied lm_head (nn.Linear): peft loads the folder onto the export with kiln's logits. An
    adapter on wq, a third of c_attn's columns, is refused naming c_attn."""
    peft = pytest.importorskip("peft")
    from kiln.checkpointing.huggingface.peft_export import export_peft
    from kiln.components.base import default_config

    folder, model = checkpoint(tmp_path, "--model.ffn.activation=gelu_tanh", *extra, tiny=GPT2)
    export(folder, tmp_path / "hf")
    targets = ["*.attention.wo", "*.feed_forward.*"]
    adapter = default_config("adapter", kind, rank=2, alpha=4, targets=[
        *targets, *(["output"] if "--model.tie_embeddings=false" in extra else [])]).build()
    adapter.apply(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".B") or name.endswith("magnitude"):
                p.add_(torch.randn_like(p) * 0.1)
    summary = export_peft(model, tmp_path / "adapter", base=str(tmp_path / "hf"),
                          fields=adapter.peft_config())
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True, (summary, config)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf",
                                                             dtype=torch.float32)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    x = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model.eval()(x), rtol=0, atol=1e-5)
    on_q = default_config("adapter", kind, rank=2, targets=["*.attention.wq"]).build()
    _, _, fresh = load_model(folder)
    on_q.apply(fresh)
    with pytest.raises(CheckpointError, match=r"layers.0.attention.wq is 32 of the 96 rows of "
                       r"transformer.h.0.attn.c_attn.weight \(GPT-2's c_attn"):
        export_peft(fresh, tmp_path / "refused", base=str(tmp_path / "hf"),
                    fields=on_q.peft_config())

"""DeepSeek-V3 in and out of Hugging Face's layout: `kiln import` of a tiny random
``DeepseekV3ForCausalLM`` (query latent, a dense layer, grouped sigmoid experts with a
correction bias and a shared expert; its multi-token prediction layer left out as transformers
leaves it) gives its logits; `kiln export` of kiln's model loads in transformers with the same
logits; what kiln's latent attention cannot take is one clear error naming the field."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.checkpointing.huggingface.layout import hf_incompatibility
from kiln.components.errors import CheckpointError
from tests.checkpointing.huggingface.hf_tiny import export_loads_back, ids, kiln_from_hf, kiln_model

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=300, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
              topk_group=1, routed_scaling_factor=2.5, kv_lora_rank=12, q_lora_rank=20,
              qk_rope_head_dim=6, v_head_dim=10, qk_nope_head_dim=8, first_k_dense_replace=1,
              max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=256,
              eos_token_id=257)


def _deepseek(folder, **overrides):
    config = transformers.DeepseekV3Config(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():  # norms, biases and the expert bias away from their init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(std=0.1)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("overrides", [{}, {"q_lora_rank": None, "first_k_dense_replace": 0,
                                            "tie_word_embeddings": True}],
                         ids=["q_latent_dense_first", "q_proj_all_moe_tied"])
def test_imported_deepseek_v3_gives_transformers_logits(tmp_path, overrides):
    hf = _deepseek(tmp_path / "hf", **overrides)
    model = kiln_from_hf(tmp_path / "hf", 32)
    x = ids(t=20)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)
    assert hf_incompatibility(model) == ""


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.8, "mscale_all_dim": 0.6}


def test_yarn_with_deepseeks_mscale_imports_and_exports(tmp_path):
    """YaRN's rotation magnitude (mscale / mscale_all_dim) and the scores' extra factor
    (mscale_all_dim's, squared): the imported model gives transformers' logits, and its export
    loads back with them (positions past the original 16, where YaRN acts)."""
    hf = _deepseek(tmp_path / "hf", rope_parameters=YARN)
    model = kiln_from_hf(tmp_path / "hf", 48)
    attn = model.blocks()[0].attention
    assert attn.score_scale == pytest.approx((0.1 * 0.6 * math.log(4.0) + 1) ** 2)
    x = ids(t=40)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)
    export_loads_back(model, tmp_path / "out", x)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["rope_parameters"]["mscale"] == pytest.approx(0.8)
    assert config["rope_parameters"]["mscale_all_dim"] == pytest.approx(0.6)


def test_llama3_rope_scaling_imports_and_exports(tmp_path):
    """Llama 3's band-wise RoPE scaling (no magnitudes): DeepSeek-V3's code takes any rope type,
    and so do kiln's import and export (positions past the original 16)."""
    llama3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 4.0,
              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    hf = _deepseek(tmp_path / "hf", rope_parameters=llama3)
    model = kiln_from_hf(tmp_path / "hf", 48)
    assert model.blocks()[0].attention.position.cfg.scaling == "llama3"
    x = ids(t=40)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)
    export_loads_back(model, tmp_path / "out", x)


def test_a_checkpoints_mtp_layer_is_left_out_as_transformers_leaves_it(tmp_path):
    hf = _deepseek(tmp_path / "hf", num_nextn_predict_layers=1)
    state = load_file(tmp_path / "hf" / "model.safetensors")
    state["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64)  # what V3's layer 61 holds
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    model = kiln_from_hf(tmp_path / "hf", 32)
    x = ids(t=12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)


def test_transformers_loads_kilns_export_with_the_same_logits(tmp_path):
    _deepseek(tmp_path / "hf")
    model = kiln_from_hf(tmp_path / "hf", 32)
    with torch.no_grad():  # kiln's own weights now: the export must carry them
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    summary = export_loads_back(model, tmp_path / "out", ids(t=16))
    assert summary["layout"] == "hf" and summary["family"] == "deepseek_v3", summary


def test_a_release_with_remote_code_needs_the_field_let_through(tmp_path):
    """DeepSeek-V3's release names its own modeling code (auto_map), which transformers 5 does
    not run without trust_remote_code: refused with the way through, which then imports."""
    hf = _deepseek(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}
    path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'auto_map': names custom model code, which kiln "
                       "does not run; kiln equals transformers' own deepseek_v3 code: .* pass "
                       "--ignore-field auto_map"):
        kiln_model(tmp_path / "hf", 32)
    from kiln.checkpointing.huggingface import importer
    from kiln.recipes.config.files import load_recipe
    from kiln.recipes.loading.hf_recipe import import_recipe

    import_recipe(str(tmp_path / "hf"), tmp_path / "r.toml", seq_len=32, ignore=("auto_map",))
    recipe = load_recipe(tmp_path / "r.toml")
    assert recipe.checkpoint.init_from_ignore == ["auto_map"]
    model = recipe.model.build(vocab_size=258, seq_len=32).eval()
    importer.load_weights(model, tmp_path / "hf", config)
    x = ids(t=12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)


def test_what_latent_attention_cannot_take_is_named(tmp_path):
    _deepseek(tmp_path / "linear", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                    "rope_theta": 10000.0, "mscale": 1.0})
    with pytest.raises(CheckpointError, match="'rope_parameters.mscale': only with rope_type "
                       "yarn"):
        kiln_model(tmp_path / "linear", 32)
    _deepseek(tmp_path / "halves", rope_interleave=False)
    with pytest.raises(CheckpointError, match="'rope_interleave': False is not supported"):
        kiln_model(tmp_path / "halves", 32)
    config = json.loads((tmp_path / "halves" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3"


def test_kiln_import_says_what_it_wrote_and_the_run_starts_from_the_weights(tmp_path, capsys):
    from kiln.recipes.cli import main
    from kiln.recipes.config.files import load_recipe
    from kiln.recipes.training.trainer import Trainer

    hf = _deepseek(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "r.toml"),
                 "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert ("deepseek_v3 with dim 32, 3 layers, 4 heads (latent attention, kv_rank 12), "
            "4 experts top 2, vocabulary 300") in out
    recipe = load_recipe(tmp_path / "r.toml", [f"--run.folder={tmp_path / 'run'}"])
    trainer = Trainer(recipe, out=open("/dev/null", "w"))  # noqa: SIM115 (the trainer keeps it)
    trainer._start_from_pretrained()
    x = ids(t=16)
    with torch.no_grad():
        torch.testing.assert_close(trainer.model.eval()(x), hf(x).logits, rtol=0, atol=1e-5)


def _quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled FP8 as DeepSeek-V3 stores it: e4m3 values and one inverse scale a block."""
    rows, cols = -(-w.shape[0] // block), -(-w.shape[1] // block)
    scales = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            scales[i, j] = tile.abs().max().clamp(min=1e-12) / 448.0
    grid = scales.repeat_interleave(block, 0).repeat_interleave(block, 1)[:w.shape[0], :w.shape[1]]
    return (w / grid).to(torch.float8_e4m3fn), scales


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3"])
def test_block_scaled_fp8_checkpoints_load_dequantized(tmp_path, family):
    """DeepSeek-V3's (and Qwen3's FP8) released form: every projection's weight in e4m3 with a
    ``_scale_inv`` per 8 x 8 block here (blocks cut short at the edges). The import equals the
    import of the same checkpoint dequantized (itself equal to transformers'), Qwen3's q/k rows
    read per head for RoPE's permutation; a rank's read of a region that starts inside a block
    dequantizes with that block's scale."""
    from kiln.checkpointing.huggingface.files import SafetensorsFolder
    from tests.checkpointing.huggingface.hf_tiny import save_tiny

    if family == "qwen3":
        save_tiny(tmp_path / "hf", "qwen3", max_position_embeddings=64)  # sharded files
    else:
        _deepseek(tmp_path / "hf")
    state = {}
    for part in sorted((tmp_path / "hf").glob("*.safetensors")):
        state.update(load_file(part))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    quantized, dequantized = {}, dict(state)
    for name, w in state.items():
        quantized[name] = w
        if w.dim() == 2 and name.endswith("proj.weight"):
            q, s = _quantize(w.float(), 8)
            quantized[name], quantized[name + "_scale_inv"] = q, s
            grid = s.repeat_interleave(8, 0).repeat_interleave(8, 1)[:w.shape[0], :w.shape[1]]
            dequantized[name] = q.float() * grid
    fp8_config = {**config, "quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": [8, 8]}}
    for folder, tensors, cfg in (("fp8", quantized, fp8_config), ("plain", dequantized, config)):
        (tmp_path / folder).mkdir()
        save_file(tensors, tmp_path / folder / "model.safetensors", metadata={"format": "pt"})
        (tmp_path / folder / "config.json").write_text(json.dumps(cfg))
    name = f"model.layers.0.self_attn.{'q_b_proj' if family == 'deepseek_v3' else 'q_proj'}.weight"
    assert (dequantized[name] - state[name]).abs().max() > 0  # the test quantizes for real
    files = SafetensorsFolder(tmp_path / "fp8")
    files.fp8_block = (8, 8)
    torch.testing.assert_close(files.read(name, (slice(3, 37), slice(5, 19))),
                               dequantized[name][3:37, 5:19], rtol=0, atol=0)
    x = ids(t=12)
    with torch.no_grad():
        torch.testing.assert_close(kiln_from_hf(tmp_path / "fp8", 32)(x),
                                   kiln_from_hf(tmp_path / "plain", 32)(x), rtol=0, atol=0)
    if family == "qwen3":
        return
    config["quantization_config"] = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'bitsandbytes' is not supported; kiln reads"):
        kiln_model(tmp_path / "plain", 32)

"""Qwen3-Next in and out of Hugging Face's layout: `kiln import` of a tiny random
``Qwen3NextForCausalLM`` (Gated DeltaNet layers with grouped key heads, gated attention with
partial RoPE and QK-norm, (1 + weight) norms, MoE with a gated shared expert, a dense layer)
gives its logits and gradients; `kiln export` of kiln's model loads in transformers with the same
logits; what kiln cannot take is one clear error naming the field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.checkpointing.huggingface import export
from kiln.checkpointing.huggingface.layout import hf_incompatibility
from kiln.components.errors import CheckpointError
from tests.checkpointing.huggingface.hf_tiny import (
    export_loads_back,
    ids,
    kiln_from_hf,
    kiln_model,
    peft_export_loads,
)

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
              shared_expert_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
              linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
              linear_value_head_dim=6, max_position_embeddings=64, mlp_only_layers=[0],
              bos_token_id=256, eos_token_id=257)


def _qwen3_next(folder, **overrides):
    config = transformers.Qwen3NextConfig(**{**CONFIG, **overrides})
    torch.manual_seed(0)
    model = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():  # norms (zero-centred: 1 + weight), gates away from their init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("overrides", [
    {}, {"mlp_only_layers": [], "tie_word_embeddings": True, "attention_bias": True,
         "layer_types": ["full_attention", "linear_attention", "full_attention",
                         "linear_attention"],
         "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0,
                             "partial_rotary_factor": 0.5}},
    {"num_experts": 0, "linear_num_key_heads": 4, "linear_conv_kernel_dim": 3},
    {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 8, "partial_rotary_factor": 0.25},
     "num_experts_per_tok": 1, "norm_topk_prob": False, "linear_num_value_heads": 6,
     "linear_num_key_heads": 3}],
    ids=["dense_first", "all_moe_tied_biased_half_rope", "dense_only", "yarn_top1_three_groups"])
def test_imported_qwen3_next_gives_transformers_logits_and_gradients(tmp_path, overrides):
    hf = _qwen3_next(tmp_path / "hf", **overrides)
    model = kiln_from_hf(tmp_path / "hf", 32)
    x = ids(t=20)
    torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)
    assert hf_incompatibility(model) == ""
    model(x).square().mean().backward()
    hf(x).logits.square().mean().backward()
    blocks = model.blocks()
    full = next(i for i, b in enumerate(blocks) if hasattr(b.attention, "wg"))
    linear = next(i for i, b in enumerate(blocks) if not hasattr(b.attention, "wg"))
    pairs = [(blocks[linear].attention.wo.weight,
              hf.model.layers[linear].linear_attn.out_proj.weight),
             (blocks[linear].attention.A_log, hf.model.layers[linear].linear_attn.A_log),
             (blocks[full].attention.wv.weight, hf.model.layers[full].self_attn.v_proj.weight),
             (model.tok_embeddings.weight, hf.model.embed_tokens.weight)]
    if hasattr(blocks[-1].feed_forward, "shared"):
        pairs.append((blocks[-1].feed_forward.shared_gate.weight,
                      hf.model.layers[-1].mlp.shared_expert_gate.weight))
    for ours, theirs in pairs:
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-5, atol=1e-7)


def test_a_released_style_config_imports(tmp_path):
    """The released checkpoints' config.json (transformers 4.57's form): rope_theta,
    partial_rotary_factor and rope_scaling at the top level, use_sliding_window false,
    full_attention_interval instead of layer_types."""
    hf = _qwen3_next(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.loads(path.read_text())
    theta = config.pop("rope_parameters")["rope_theta"]
    del config["layer_types"]
    config.update(rope_theta=theta, partial_rotary_factor=0.25, rope_scaling=None,
                  use_sliding_window=False, sliding_window=None, full_attention_interval=4)
    path.write_text(json.dumps(config))
    model = kiln_from_hf(tmp_path / "hf", 32)
    x = ids(t=12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)


def test_transformers_loads_kilns_export_with_the_same_logits(tmp_path):
    _qwen3_next(tmp_path / "hf")
    model = kiln_from_hf(tmp_path / "hf", 32)
    with torch.no_grad():  # kiln's own weights now: the export must carry them
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    summary = export_loads_back(model, tmp_path / "out", ids(t=16))
    assert summary["layout"] == "hf" and summary["family"] == "qwen3_next", summary
    model.blocks()[-1].feed_forward.expert_bias[0] = 0.01  # balancing moved it
    with pytest.raises(CheckpointError, match=r"layers.3.feed_forward.expert_bias is not zero "
                       r"\(aux-loss-free balancing moved it\) and qwen3_next routes without it"):
        export.export(model, None, tmp_path / "again", model_table={}, recipe_file=None)


def test_a_checkpoints_mtp_weights_are_left_out_as_transformers_leaves_them(tmp_path):
    hf = _qwen3_next(tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    state["mtp.fc.weight"] = torch.zeros(32, 64)  # what the released checkpoints hold
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    model = kiln_from_hf(tmp_path / "hf", 32)
    x = ids(t=12)
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=0, atol=1e-5)


def test_what_kiln_cannot_take_is_named(tmp_path):
    _qwen3_next(tmp_path / "hf", mlp_only_layers=[1])
    with pytest.raises(CheckpointError, match=r"'mlp_only_layers': \[1\]: kiln's dense layers "
                       "are the first"):
        kiln_model(tmp_path / "hf", 32)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config.update(mlp_only_layers=[], decoder_sparse_step=2)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'decoder_sparse_step': 2 is not supported"):
        kiln_model(tmp_path / "hf", 32)


def test_kiln_models_without_the_layout_say_why(tmp_path):
    """An output gate or a partial RoPE outside Qwen3-Next's layout, and an MoE without the
    shared expert's gate, are named rather than exported wrongly."""
    _qwen3_next(tmp_path / "hf")
    assert hf_incompatibility(kiln_model(tmp_path / "hf", 32, "--model.ffn.shared_gate=false")
                              ).startswith("Qwen3-Next layout: MoE layers need")
    assert "output gate" in hf_incompatibility(
        kiln_model(tmp_path / "hf", 32, "--model.attention.qk_norm=false"))
    from tests.checkpointing.huggingface.hf_tiny import save_tiny

    save_tiny(tmp_path / "llama", "llama")
    partial = kiln_model(tmp_path / "llama", 32, "--model.attention.position.fraction=0.5")
    assert hf_incompatibility(partial) == ("partial RoPE (position.fraction < 1): only "
                                           "Qwen3-Next's layout has it")


def test_kiln_import_says_what_it_wrote(tmp_path, capsys):
    from kiln.recipes.cli import main

    _qwen3_next(tmp_path / "hf")
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "r.toml"),
                 "--seq-len", "16"]) == 0
    assert ("qwen3_next with dim 32, 4 layers, 4 heads / 2 kv heads (3 linear-attention "
            "layers: gated_deltanet), 4 experts top 2, vocabulary 300") in capsys.readouterr().out


@pytest.mark.parametrize("heads", [1, 2], ids=["one_piece", "pieces"])
def test_a_peft_export_of_adapters_on_part_of_a_fused_module_is_refused(tmp_path, heads):
    """LoRA on wq: Qwen3-Next's q_proj also holds the gate, its in_proj_qkvz the k, v and z
    rows. With one head (one key head), wq is a single piece at row 0 of those tensors: the
    check must not take it for the whole module."""
    from kiln.checkpointing.huggingface.peft_export import peft_tensors
    from kiln.components.base import default_config

    _qwen3_next(tmp_path / "hf", num_attention_heads=heads, num_key_value_heads=1,
                linear_num_key_heads=heads, linear_num_value_heads=heads)
    model = kiln_model(tmp_path / "hf", 32)
    default_config("adapter", "lora", rank=2, targets=["*.attention.wq"]).build().apply(model)
    with pytest.raises(CheckpointError, match=r"--format peft: layers.0.attention.wq is 8 of the "
                       r"\d+ rows of model.layers.0.linear_attn.in_proj_qkvz.weight|is made of"):
        peft_tensors(model)


def test_a_peft_export_loads_in_peft_with_kilns_logits_and_mlp_targets_are_refused(tmp_path):
    """LoRA on both attention kinds' output projections (o_proj, out_proj) and the head: peft
    loads the adapter folder onto the Hugging Face base with kiln's logits. On a shared expert's
    projection the export refuses: peft would put it on the routed experts' fused weights."""
    from kiln.checkpointing.huggingface.peft_export import export_peft
    from kiln.components.base import default_config

    _qwen3_next(tmp_path / "hf")
    theirs, ours = peft_export_loads(kiln_from_hf(tmp_path / "hf", 32), tmp_path / "hf",
                                     tmp_path / "adapter", ["*.attention.wo", "output"],
                                     ids(t=12))
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    shared = kiln_from_hf(tmp_path / "hf", 32)
    on_shared = default_config("adapter", "lora", rank=2, targets=["*.feed_forward.shared.w1"]
                               ).build()
    on_shared.apply(shared)
    with pytest.raises(CheckpointError, match="layers.1.feed_forward.shared.w1 is model.layers.1"
                       ".mlp.shared_expert.gate_proj; peft renames every gate/gate_proj"):
        export_peft(shared, tmp_path / "refused", base=str(tmp_path / "hf"),
                    fields=on_shared.peft_config())

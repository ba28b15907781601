"""config.json -> kiln model table: what maps where, and one error naming the field for
everything kiln cannot compute the same way."""

from __future__ import annotations

import pytest

from kiln.checkpointing.huggingface import config as hf_config
from kiln.components.errors import CheckpointError

LLAMA_31 = {  # Llama 3.1 8B's config.json (transformers 4 format)
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
    "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192,
                                            "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.0.dev0", "use_cache": True, "vocab_size": 128256,
}


def test_llama_31_maps_to_the_kiln_table():
    t = hf_config.model_table(LLAMA_31, "meta-llama")
    assert (t["dim"], t["n_layers"], t["vocab_size"], t["tie_embeddings"]) == (4096, 32, 128256,
                                                                               False)
    assert t["attention"]["n_heads"] == 32 and t["attention"]["n_kv_heads"] == 8
    assert "head_dim" not in t["attention"] and "bias" not in t["attention"]
    assert t["attention"]["position"] == {
        "type": "rope", "theta": 500000.0, "scaling": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_seq_len": 8192}
    assert t["ffn"] == {"type": "swiglu", "hidden_dim": 14336}
    assert t["norm"] == {"type": "rmsnorm", "eps": 1e-05}


def test_qwen_families():
    qwen2 = {**LLAMA_31, "model_type": "qwen2", "rope_scaling": None, "sliding_window": 4096,
             "use_sliding_window": False, "max_window_layers": 28}
    for k in ("attention_bias", "mlp_bias", "pretraining_tp"):
        qwen2.pop(k)
    t = hf_config.model_table(qwen2, "q")
    assert t["attention"]["qkv_bias"] is True and "qk_norm" not in t["attention"]
    assert hf_config.windows(qwen2, "q") == (0, [])  # use_sliding_window = false
    assert "window" not in t["attention"] and "layer_types" not in t
    qwen3 = {**qwen2, "model_type": "qwen3", "head_dim": 256, "attention_bias": False,
             "rms_norm_eps": 1e-6}
    t = hf_config.model_table(qwen3, "q")
    assert t["attention"]["qk_norm"] is True and t["attention"]["qk_norm_eps"] == 1e-6
    assert t["attention"]["head_dim"] == 256 and "qkv_bias" not in t["attention"]


@pytest.mark.parametrize("change, field", [
    ({"model_type": "gemma"}, "model_type"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "mscale": 1.0}},
     "rope_scaling.mscale"),
    ({"quantization_config": {"bits": 4}}, "quantization_config"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),  # llama
    ({"model_type": "mistral", "layer_types": ["full_attention", "linear_attention"]},
     "layer_types"),
    ({"some_new_knob": 3}, "some_new_knob"),
])
def test_unsupported_fields_are_errors_naming_the_field(change, field):
    with pytest.raises(CheckpointError, match=f"field '{field}'"):
        hf_config.model_table({**LLAMA_31, **change}, "src")


def test_missing_field():
    config = {k: v for k, v in LLAMA_31.items() if k != "num_hidden_layers"}
    with pytest.raises(CheckpointError, match="field 'num_hidden_layers': missing"):
        hf_config.model_table(config, "src")


def test_ignore_lets_a_named_field_through():
    config = {**LLAMA_31, "some_new_knob": 3}
    assert hf_config.model_table(config, "src", ignore=("some_new_knob",))["dim"] == 4096


def test_sliding_windows_map_to_the_window_and_layer_types():
    mistral = {**LLAMA_31, "model_type": "mistral", "sliding_window": 4096}
    for k in ("attention_bias", "mlp_bias", "pretraining_tp"):
        mistral.pop(k)
    t = hf_config.model_table(mistral, "m")
    assert t["attention"]["window"] == 4096 and "layer_types" not in t  # every layer slides
    assert t["max_seq_len"] == 131072  # the window is checked against the model's context
    qwen3 = {**mistral, "model_type": "qwen3", "num_hidden_layers": 4, "use_sliding_window": True,
             "max_window_layers": 2}
    t = hf_config.model_table(qwen3, "q")  # transformers' rule: from max_window_layers on
    assert t["layer_types"] == ["full", "full", "sliding", "sliding"]
    listed = {**qwen3, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert hf_config.windows(listed, "q") == (4096, ["sliding", "full", "sliding", "full"])


def test_transformers_5_rope_parameters():
    config = {**LLAMA_31, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32768,
                                              "rope_theta": 1e6, "beta_fast": 32.0}}
    del config["rope_scaling"], config["rope_theta"]
    rope = hf_config.model_table(config, "src")["attention"]["position"]
    assert rope == {"type": "rope", "theta": 1e6, "scaling": "yarn", "factor": 4.0,
                    "original_max_seq_len": 32768, "beta_fast": 32.0}

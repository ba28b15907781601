"""Hugging Face ``config.json`` <-> kiln's ``[model]`` table, for the Llama family (Llama 2/3/3.1/
3.2, Mistral, SmolLM, TinyLlama), Qwen2 (q/k/v biases), Qwen3 (QK-norm) and GPT-2 (``gpt2``).

Import is strict: every field of the config is either mapped onto the recipe, checked to hold
the one value kiln computes the same way (``hidden_act = "silu"``, no dropout, no MLP bias, ...),
or known not to change the computation (ids, dtype, ``use_cache``, ...). Anything else is an
error naming the field, never a silent mismatch; a field known to be harmless can be let through
with ``ignore`` (``checkpoint.init_from_ignore`` / ``kiln import --ignore-field``).
"""

from __future__ import annotations

from typing import Any

from kiln.checkpointing.huggingface import fp8, mxfp4
from kiln.checkpointing.huggingface.families import deepseek, gpt2, qwen3_next
from kiln.checkpointing.huggingface.rope import fail as _fail
from kiln.checkpointing.huggingface.rope import rope_parameters, rope_table

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "deepseek_v3", "gpt_oss", "qwen3_next")
GPT_OSS_FIELDS = frozenset(["num_local_experts", "num_experts_per_tok", "swiglu_alpha",
                            "swiglu_limit", "router_aux_loss_coef", "output_router_logits",
                            # in the released config.json, read by no transformers code:
                            # num_experts_per_tok and YaRN's original length are the ones used
                            "experts_per_token", "initial_context_length"])

# Fields that do not change the network's computation (metadata, ids, generation defaults).
HARMLESS = frozenset([
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id", "decoder_start_token_id",
    "_name_or_path", "name_or_path", "pretraining_tp", "return_dict", "output_attentions",
    "output_hidden_states", "torchscript", "use_bfloat16", "tie_encoder_decoder",
    "is_encoder_decoder", "is_decoder", "add_cross_attention", "chunk_size_feed_forward",
    "id2label", "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
    "finetuning_task", "cross_attention_hidden_size", "tf_legacy_loss", "pruned_heads",
    "max_length", "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups",
    "diversity_penalty", "temperature", "top_k", "top_p", "typical_p", "repetition_penalty",
    "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
    "num_return_sequences", "output_scores", "return_dict_in_generate", "forced_bos_token_id",
    "forced_eos_token_id", "remove_invalid_values", "exponential_decay_length_penalty",
    "suppress_tokens", "begin_suppress_tokens", "is_llama_config", "max_position_embeddings",
    "initializer_range",
])
# Mapped or checked below.
MODEL_FIELDS = frozenset([
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "rms_norm_eps", "tie_word_embeddings",
    "attention_bias", "attention_dropout", "mlp_bias", "rope_theta", "rope_scaling",
    "rope_parameters", "partial_rotary_factor", "rope_interleaved", "sliding_window",
    "use_sliding_window", "max_window_layers", "layer_types",
])
def model_table(config: dict, source: str, ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """The kiln ``[model]`` table equal to a Hugging Face config (CheckpointError otherwise)."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise _fail(source, "model_type", f"{family!r} is not supported",
                    f"kiln imports {', '.join(FAMILIES)}")
    known = {"gpt2": gpt2.FIELDS | gpt2.SUMMARY, "deepseek_v3": deepseek.FIELDS,
             "gpt_oss": MODEL_FIELDS | GPT_OSS_FIELDS,
             "qwen3_next": qwen3_next.FIELDS}.get(family, MODEL_FIELDS)
    if fp8.block_size(config, source) or mxfp4.applies(config):  # dequantized when read
        known = known | {"quantization_config"}
    if "auto_map" in config and "auto_map" not in ignore:
        raise _fail(source, "auto_map", "names custom model code, which kiln does not run",
                    f"kiln equals transformers' own {family} code: if the checkpoint is meant for "
                    "it too (transformers loads it without trust_remote_code, as DeepSeek-V3's "
                    "release), pass --ignore-field auto_map (checkpoint.init_from_ignore)")
    for name in config:
        if name not in HARMLESS and name not in known and name not in ignore:
            raise _fail(source, name, "unknown to kiln's import, so it may change the model",
                        "if it does not change the computation, pass it to --ignore-field "
                        "(checkpoint.init_from_ignore)")
    if family == "gpt2":
        return gpt2.model_table(config, source, ignore)
    if family == "deepseek_v3":
        return deepseek.model_table(config, source, ignore)
    if family == "qwen3_next":
        return qwen3_next.model_table(config, source, ignore)
    checks = {"hidden_act": "silu", "attention_dropout": 0.0, "mlp_bias": False,
              "partial_rotary_factor": 1.0, "rope_interleaved": False}
    for name, want in checks.items():
        if config.get(name, want) != want and name not in ignore:
            raise _fail(source, name, f"{config[name]!r} is not supported (kiln: {want!r})")
    try:
        dim, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        layers, ffn = int(config["num_hidden_layers"]), int(config["intermediate_size"])
        vocab = int(config["vocab_size"])
    except KeyError as exc:
        raise _fail(source, exc.args[0], "missing") from None
    window, layer_types = windows(config, source)
    kv = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or dim // heads)
    eps = float(config.get("rms_norm_eps", 1e-6))
    attention: dict[str, Any] = {"type": "causal", "n_heads": heads, "n_kv_heads": kv}
    if head_dim * heads != dim or dim % heads:
        attention["head_dim"] = head_dim
    if family == "qwen2":
        attention["qkv_bias"] = True
    elif config.get("attention_bias"):
        attention["bias"] = True
    if family == "qwen3":
        attention["qk_norm"] = True
        attention["qk_norm_eps"] = eps
    attention["position"] = rope_table(config, source)
    if window:
        attention["window"] = window
    table: dict[str, Any] = {
        "type": "transformer", "dim": dim, "n_layers": layers, "vocab_size": vocab,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "init_std": float(config.get("initializer_range", 0.02)),
        "attention": attention,
        "ffn": {"type": "swiglu", "hidden_dim": ffn},
        "norm": {"type": "rmsnorm", "eps": eps},
    }
    if family == "gpt_oss":  # sinks, and its experts in place of the SwiGLU
        attention["sinks"] = True
        table["ffn"] = {"type": "moe", "experts": "gpt_oss", "router_bias": True,
                        "n_experts": int(config["num_local_experts"]),
                        "top_k": int(config["num_experts_per_tok"]), "hidden_dim": ffn,
                        "swiglu_limit": float(config.get("swiglu_limit", 7.0)),
                        "swiglu_alpha": float(config.get("swiglu_alpha", 1.702)),
                        "bias_update_coeff": 0.0}
    if layer_types:
        table["layer_types"] = layer_types
    if window:  # the window is checked against the model's context, not the recipe's rows
        table["max_seq_len"] = max(window, int(config.get("max_position_embeddings") or window))
    return table


def windows(config: dict, source: str) -> tuple[int, list[str]]:
    """The sliding window a config asks for (0: none) and kiln's ``model.layer_types`` ([]:
    every layer by the window). Mistral windows every layer; Qwen2 / Qwen3 window the layers
    their ``layer_types`` name ``sliding_attention`` (from ``max_window_layers`` on, when a
    config has no list) and only with ``use_sliding_window``."""
    family = config.get("model_type")
    kinds = {"full_attention": "full", "sliding_attention": "sliding"}
    listed = config.get("layer_types") or []
    unknown = sorted(set(listed) - set(kinds))
    if unknown:
        raise _fail(source, "layer_types", f"{unknown}: kiln has full and sliding-window "
                    "attention layers only")
    window = int(config.get("sliding_window") or 0)
    if family == "llama" and "sliding_attention" in listed:
        raise _fail(source, "layer_types", "sliding_attention layers in a llama config (its "
                    "model code has no window)")
    if family in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        return 0, []
    if not window or family == "llama":
        return 0, []
    if family == "mistral" and not listed:
        return window, []
    n = int(config["num_hidden_layers"])
    if not listed:  # transformers' rule: the layers from max_window_layers on slide
        first = int(config.get("max_window_layers") or n)
        listed = ["full_attention" if i < first else "sliding_attention" for i in range(n)]
    types = [kinds[t] for t in listed]
    return window, ([] if set(types) == {"sliding"} else types)


def family_of(model) -> str:
    """The Hugging Face family whose layout the model has: llama (mistral with a sliding
    window), qwen2, qwen3, gpt2 (learned positions), deepseek_v3 (latent attention), gpt_oss
    (its experts) or qwen3_next (Gated DeltaNet layers or gated attention)."""
    if getattr(model, "pos_embeddings", None) is not None:
        return "gpt2"
    attn = model.blocks()[0].attention
    if hasattr(attn, "wkv_b"):  # latent attention
        return "deepseek_v3"
    if hasattr(model.blocks()[0].feed_forward, "w13"):  # gpt-oss's experts
        return "gpt_oss"
    if qwen3_next.is_qwen3_next(model):
        return "qwen3_next"
    bias = attn.wo.bias is not None
    qkv_bias = (attn.wqkv if hasattr(attn, "wqkv") else attn.wq).bias is not None
    if attn.q_norm is not None:
        return "qwen3"
    if qkv_bias and not bias:
        return "qwen2"
    return "mistral" if layer_windows(model)[0] else "llama"


def layer_windows(model) -> tuple[int, list[int]]:
    """The model's window (0: none) and each layer's (0 for a full-attention layer)."""
    per_layer = [b.attention.window for b in model.blocks()]
    return max(per_layer), per_layer


def hf_config(model, tokenizer, family: str) -> dict[str, Any]:
    """config.json of a kiln transformer with a Hugging Face layout (``hf_incompatibility``
    is empty), in transformers 5's format."""
    if family == "gpt2":
        return gpt2.hf_config(model, tokenizer)
    if family == "deepseek_v3":
        return deepseek.hf_config(model, tokenizer)
    if family == "qwen3_next":
        return qwen3_next.hf_config(model, tokenizer)
    blocks = model.blocks()
    attn0, ffn0 = blocks[0].attention, blocks[0].feed_forward
    rope = attn0.position.cfg
    params = rope_parameters(rope)
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "gpt_oss": "GptOssForCausalLM"}[family]
    config: dict[str, Any] = {
        "architectures": [arch],
        "model_type": family,
        "vocab_size": model.vocab_size,
        "hidden_size": model.dim,
        "intermediate_size": ffn0.hidden_dim,
        "num_hidden_layers": len(blocks),
        "num_attention_heads": attn0.n_heads,
        "num_key_value_heads": attn0.n_kv_heads,
        "head_dim": attn0.head_dim,
        "hidden_act": "silu",
        # the trained context, or what a scaled RoPE was made for (transformers checks that
        # original_max_position_embeddings is below it)
        "max_position_embeddings": max(model.max_seq_len, int(rope.original_max_seq_len
                                                              * rope.factor)),
        "rms_norm_eps": model.norm.eps,
        "rope_parameters": params,  # transformers >= 5; rope_theta/rope_scaling: older
        "rope_theta": rope.theta,
        "tie_word_embeddings": bool(model.tied),
        "initializer_range": model.init_std,
        "bos_token_id": getattr(tokenizer, "bos_id", None),
        "eos_token_id": getattr(tokenizer, "eos_id", None),
        "pad_token_id": getattr(tokenizer, "pad_id", None),
        "attention_dropout": 0.0,
        "use_cache": True,
        "dtype": str(model.tok_embeddings.weight.dtype).removeprefix("torch."),
    }
    if rope.scaling != "none":
        config["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    if family == "llama":
        config.update(attention_bias=attn0.wo.bias is not None, mlp_bias=False)
    if family == "qwen3":
        config["attention_bias"] = attn0.wo.bias is not None
    window, per_layer = layer_windows(model)
    if family == "mistral":
        config["sliding_window"] = window
    if family == "gpt_oss":
        moe = ffn0.cfg
        config.update(attention_bias=True,
                      num_local_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                      swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha,
                      sliding_window=window or None,
                      layer_types=["sliding_attention" if w else "full_attention"
                                   for w in per_layer])
    if family in ("qwen2", "qwen3"):
        types = ["sliding_attention" if w else "full_attention" for w in per_layer]
        leading = next((i for i, w in enumerate(per_layer) if w), len(per_layer))
        config.update(use_sliding_window=bool(window), sliding_window=window or None,
                      max_window_layers=leading, layer_types=types)
    return config


def generation_config(tokenizer) -> dict[str, Any]:
    """generation_config.json: the special token ids (transformers' defaults otherwise)."""
    out = {"bos_token_id": getattr(tokenizer, "bos_id", None),
           "eos_token_id": getattr(tokenizer, "eos_id", None)}
    pad = getattr(tokenizer, "pad_id", None)
    if pad is not None:
        out["pad_token_id"] = pad
    return out

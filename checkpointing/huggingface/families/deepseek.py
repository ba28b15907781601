"""DeepSeek-V3 (``model_type = "deepseek_v3"``) in Hugging Face's layout: its ``config.json`` <->
kiln's ``[model]`` table, and which of its tensors make up each kiln parameter.

=======================================================  ==========================================
kiln                                                     Hugging Face (``DeepseekV3ForCausalLM``)
=======================================================  ==========================================
``layers.N.attention.wq`` / ``wq_a``, ``q_norm``, ``wq_b``  ``self_attn.q_proj`` / ``q_a_proj``,
                                                         ``q_a_layernorm``, ``q_b_proj``
``layers.N.attention.wkv_a``, ``kv_norm``, ``wkv_b``     ``self_attn.kv_a_proj_with_mqa``,
                                                         ``kv_a_layernorm``, ``kv_b_proj``
``layers.N.attention.wo``                                ``self_attn.o_proj``
``layers.N.feed_forward.w1 / w3 / w2`` (dense layers)    ``mlp.gate_proj / up_proj / down_proj``
``layers.N.feed_forward.router``, ``expert_bias``        ``mlp.gate.weight``,
                                                         ``mlp.gate.e_score_correction_bias``
``layers.N.feed_forward.w1[e] / w3[e] / w2[e]``          ``mlp.experts.e.gate_proj / up_proj /
                                                         down_proj.weight`` (each transposed)
``layers.N.feed_forward.shared.w1 / w3 / w2``            ``mlp.shared_experts.gate_proj / ...``
=======================================================  ==========================================

plus the Llama names for the embeddings, the block norms, the final norm and the head. The
checkpoints' rope dimensions come in adjacent pairs (``rope_interleave = true``), kiln's RoPE
layout, so nothing is permuted. A checkpoint's multi-token prediction layers (layer indices from
``num_hidden_layers`` on) are not loaded, as transformers does not load them: kiln's ``mtp``
modules, if the recipe has them, keep their initialisation.
"""

from __future__ import annotations

import math
import re
from typing import Any

from torch import nn

from kiln.checkpointing.huggingface.families.common import block_problem, ends, layer_parts
from kiln.checkpointing.huggingface.parts import Part
from kiln.checkpointing.huggingface.rope import rope_parameters, rope_table
from kiln.components.errors import CheckpointError

FIELDS = frozenset([  # mapped or checked in model_table
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
    "qk_nope_head_dim", "qk_head_dim", "head_dim", "n_group", "topk_group",
    "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "hidden_act",
    "rms_norm_eps", "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
    "rope_interleave", "attention_bias", "attention_dropout", "num_nextn_predict_layers",
    "output_router_logits", "router_aux_loss_coef", "aux_loss_alpha", "seq_aux", "scoring_func",
    "topk_method", "ep_size", "moe_layer_freq",
])


def _fail(source: str, field: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{source}: config.json field {field!r}: {problem}")


def model_table(config: dict, source: str, ignore: tuple[str, ...]) -> dict[str, Any]:
    """The kiln ``[model]`` table equal to a DeepSeek-V3 config (CheckpointError otherwise)."""
    checks = {"hidden_act": "silu", "attention_dropout": 0.0, "rope_interleave": True,
              "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    for name, want in checks.items():
        if config.get(name, want) != want and name not in ignore:
            raise _fail(source, name, f"{config[name]!r} is not supported (kiln: {want!r})")
    rope, score_scale = _rope(config, source)
    try:
        dim, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads, experts = int(config["num_attention_heads"]), int(config["n_routed_experts"])
    except KeyError as exc:
        raise _fail(source, exc.args[0], "missing") from None
    if int(config.get("num_key_value_heads") or heads) != heads:
        raise _fail(source, "num_key_value_heads", "must equal num_attention_heads (latent "
                    "attention expands its keys for every head)")
    dense = min(int(config.get("first_k_dense_replace") or 0), layers)
    moe_hidden = int(config["moe_intermediate_size"])
    attention = {"type": "latent", "n_heads": heads, "kv_rank": int(config["kv_lora_rank"]),
                 "q_rank": int(config.get("q_lora_rank") or 0),
                 "nope_head_dim": int(config["qk_nope_head_dim"]),
                 "rope_head_dim": int(config["qk_rope_head_dim"]),
                 "v_head_dim": int(config["v_head_dim"]),
                 "bias": bool(config.get("attention_bias", False)), "position": rope}
    if score_scale != 1.0:
        attention["score_scale"] = score_scale
    swiglu = {"type": "swiglu", "hidden_dim": int(config["intermediate_size"])}
    moe = {"type": "moe", "n_experts": experts, "top_k": int(config["num_experts_per_tok"]),
           "hidden_dim": moe_hidden, "score": "sigmoid",
           "renormalize": bool(config.get("norm_topk_prob", True)),
           "route_scale": float(config.get("routed_scaling_factor", 1.0)),
           "n_shared_experts": int(config.get("n_shared_experts") or 0),
           "n_groups": int(config.get("n_group") or 1),
           "topk_groups": int(config.get("topk_group") or 1)}
    table: dict[str, Any] = {
        "type": "transformer", "dim": dim, "n_layers": layers,
        "vocab_size": int(config["vocab_size"]),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "init_std": float(config.get("initializer_range", 0.02)),
        "attention": attention, "ffn": swiglu if dense == layers else moe,
        "norm": {"type": "rmsnorm", "eps": float(config.get("rms_norm_eps", 1e-6))},
    }
    if 0 < dense < layers:
        table.update(dense_layers=dense, dense_ffn=swiglu)
    return table


def mscale(factor: float, m: float) -> float:
    """DeepSeek's YaRN magnitude: 0.1 m ln(factor) + 1 (1 for factor <= 1)."""
    return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0


def _rope(config: dict, source: str) -> tuple[dict, float]:
    """The position table and the score scale of DeepSeek's RoPE: under YaRN, ``mscale`` and
    ``mscale_all_dim`` give the rotation's magnitude (their ratio, transformers'
    ``attention_factor``) and the scores' extra factor (``mscale_all_dim``'s, squared)."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = dict(config.get(key) or {})
    m, m_all = params.pop("mscale", None), params.pop("mscale_all_dim", None)
    factor = float(params.get("factor") or 1.0)
    if (m or m_all) and params.get("rope_type", params.get("type")) != "yarn":
        raise _fail(source, f"{key}.mscale", "only with rope_type yarn")
    if m and m_all and params.get("attention_factor") is None:
        params["attention_factor"] = mscale(factor, m) / mscale(factor, m_all)
    rope = rope_table({**config, key: params}, source)
    return rope, (mscale(factor, m_all) ** 2 if m_all else 1.0)


def unused(name: str, config: dict) -> bool:
    """A checkpoint tensor transformers does not load either: a multi-token prediction layer."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return bool(m) and int(m.group(1)) >= int(config.get("num_hidden_layers") or 0)


def incompatibility(model: nn.Module) -> str:
    """Why a transformer with latent attention has no DeepSeek-V3 layout ("" if it has)."""
    from kiln.components.attention.latent import LatentAttention
    from kiln.components.ffn.moe import MoE
    from kiln.components.ffn.swiglu import SwiGLU
    from kiln.components.positions.rope import RoPE

    blocks, eps = model.blocks(), model.norm.eps
    kinds = [type(b.feed_forward) for b in blocks]
    dense = kinds.index(MoE) if MoE in kinds else len(kinds)
    if any(k is not SwiGLU for k in kinds[:dense]) or any(k is not MoE for k in kinds[dense:]):
        return "DeepSeek-V3 layout: SwiGLU layers, then MoE layers, nothing else"
    for i, block in enumerate(blocks):
        attn, ffn = block.attention, block.feed_forward
        if type(attn) is not LatentAttention:
            return f"DeepSeek-V3 layout: layer {i} attention is {type(attn).__name__}"
        if attn.window or attn.q_scale != 1.0 or type(attn.position) is not RoPE:
            return "DeepSeek-V3 layout: a window, µP's query scale or a position but RoPE"
        if attn.score_scale != 1.0 and attn.position.cfg.scaling != "yarn":
            return "DeepSeek-V3 layout: a score scale without YaRN (its mscale_all_dim)"
        if attn.kv_norm.eps != 1e-6 or (attn.wo.bias is not None and hasattr(attn, "wq")):
            return ("DeepSeek-V3 layout: latent norms with eps other than 1e-6, or attention "
                    "biases without a query latent")
        problem = block_problem(block, eps, "DeepSeek-V3 layout: ")
        if problem:
            return problem
        if isinstance(ffn, MoE) and (ffn.cfg.score != "sigmoid" or ffn.cfg.capacity_factor
                                     or ffn.shared is None
                                     or ffn.shared.hidden_dim != ffn.hidden_dim
                                     * ffn.cfg.n_shared_experts):
            return ("DeepSeek-V3 layout: MoE layers need sigmoid scores, no capacity limit and "
                    "n_shared_experts x hidden_dim shared experts")
    moes = {(f.n_experts, f.top_k, f.hidden_dim, f.cfg.n_groups, f.cfg.topk_groups,
             f.cfg.route_scale, f.cfg.renormalize) for f in (b.feed_forward for b in blocks)
            if isinstance(f, MoE)}
    denses = {b.feed_forward.hidden_dim for b in blocks[:dense]}
    if len(moes) > 1 or len(denses) > 1:
        return "DeepSeek-V3 layout: layers of different feed-forward settings"
    return ""


def parts(model: nn.Module) -> dict[str, list[Part]]:
    """kiln state-dict name -> the DeepSeek-V3 tensors it is made of (module docstring)."""
    out = ends(model)
    names = {"wq": "q_proj", "wq_a": "q_a_proj", "q_norm": "q_a_layernorm", "wq_b": "q_b_proj",
             "wkv_a": "kv_a_proj_with_mqa", "kv_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj",
             "wo": "o_proj"}
    for i, block in enumerate(model.blocks()):
        kn, hf = f"layers.{i}.", f"model.layers.{i}."
        attn, ffn = block.attention, block.feed_forward
        for name, module in attn.named_children():
            if name in names:
                for leaf, t in module.named_parameters(recurse=False):
                    out[f"{kn}attention.{name}.{leaf}"] = [
                        Part(f"{hf}self_attn.{names[name]}.{leaf}", t.shape[0])]
        out.update(layer_parts(ffn, kn, hf, model.dim, "shared_experts"))
        if hasattr(ffn, "router"):
            out[f"{kn}feed_forward.expert_bias"] = [
                Part(hf + "mlp.gate.e_score_correction_bias", ffn.n_experts)]
    return out


def _rope_parameters(attn: nn.Module) -> dict[str, Any]:
    """``rope_parameters`` of latent attention's RoPE: YaRN's ``mscale_all_dim`` from the
    score scale and ``mscale`` from the rotation's magnitude (``_rope``'s inverse)."""
    rope = attn.position.cfg
    if rope.scaling != "yarn":  # no magnitudes: the families' common parameters
        return rope_parameters(rope)
    log_f = 0.1 * math.log(rope.factor)
    m_all = (math.sqrt(attn.score_scale) - 1.0) / log_f
    magnitude = rope.attention_factor or (log_f + 1.0)
    m = (magnitude * mscale(rope.factor, m_all) - 1.0) / log_f
    return {"rope_type": "yarn", "rope_theta": rope.theta, "factor": rope.factor,
            "original_max_position_embeddings": rope.original_max_seq_len,
            "beta_fast": rope.beta_fast, "beta_slow": rope.beta_slow,
            "truncate": rope.yarn_truncate, "mscale": m, "mscale_all_dim": m_all}


def hf_config(model: nn.Module, tokenizer) -> dict[str, Any]:
    """config.json of a kiln transformer with the DeepSeek-V3 layout."""
    blocks = model.blocks()
    attn = blocks[0].attention
    moe = next((b.feed_forward for b in blocks if hasattr(b.feed_forward, "router")), None)
    dense = [b.feed_forward for b in blocks if not hasattr(b.feed_forward, "router")]
    rope = attn.position.cfg  # what a scaled RoPE was made for must fit the context
    context = max(model.max_seq_len, int(rope.original_max_seq_len * rope.factor))
    config: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": model.vocab_size, "hidden_size": model.dim,
        "num_hidden_layers": len(blocks), "num_attention_heads": attn.n_heads,
        "num_key_value_heads": attn.n_heads, "kv_lora_rank": attn.kv_rank,
        "q_lora_rank": attn.wq_a.out_features if hasattr(attn, "wq_a") else None,
        "qk_nope_head_dim": attn.nope, "qk_rope_head_dim": attn.rope,
        "v_head_dim": attn.v_dim, "rope_interleave": True, "attention_bias": attn.wo.bias
        is not None, "rope_parameters": _rope_parameters(attn),
        "first_k_dense_replace": len(dense), "hidden_act": "silu",
        "intermediate_size": dense[0].hidden_dim if dense else moe.hidden_dim,
        "rms_norm_eps": model.norm.eps, "tie_word_embeddings": bool(model.tied),
        "initializer_range": model.init_std, "max_position_embeddings": context,
        "num_nextn_predict_layers": 0, "attention_dropout": 0.0, "use_cache": True,
        "bos_token_id": getattr(tokenizer, "bos_id", None),
        "eos_token_id": getattr(tokenizer, "eos_id", None),
        "pad_token_id": getattr(tokenizer, "pad_id", None),
        "dtype": str(model.tok_embeddings.weight.dtype).removeprefix("torch."),
    }
    if moe is not None:
        c = moe.cfg
        config.update(n_routed_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                      moe_intermediate_size=moe.hidden_dim, n_shared_experts=c.n_shared_experts,
                      n_group=c.n_groups, topk_group=c.topk_groups, norm_topk_prob=c.renormalize,
                      routed_scaling_factor=c.route_scale)
    return config

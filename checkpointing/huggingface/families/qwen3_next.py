"""Qwen3-Next (``model_type = "qwen3_next"``) in Hugging Face's layout: its ``config.json`` <->
kiln's ``[model]`` table, and which of its tensors make up each kiln parameter.

A kiln hybrid: ``"linear"`` layers of Gated DeltaNet (``model.linear_attention``), ``"full"``
layers of causal attention with QK-norm, an output gate and partial RoPE
(``position.fraction``), MoE feed-forwards with a gated shared expert (``shared_gate``).

====================================================  =============================================
kiln                                                  Hugging Face (``Qwen3NextForCausalLM``)
====================================================  =============================================
``attention.wq`` (partial RoPE perm.), ``wg``          ``self_attn.q_proj``: per head its query
                                                      rows, then its gate's
``attention.wk`` (perm.), ``wv``, ``wo``               ``self_attn.k_proj``, ``v_proj``, ``o_proj``
``attention.q_norm`` / ``k_norm`` (perm., + 1)         ``self_attn.q_norm`` / ``k_norm``
``attention.wq / wk / wv / wz`` (a linear layer)       ``linear_attn.in_proj_qkvz``: per key head
                                                      its q, k, then its value heads' v and z
``attention.wb / wa``                                 ``linear_attn.in_proj_ba``: per key head its
                                                      value heads' b, then their a
``attention.conv``, ``A_log``, ``dt_bias``, ``wo``    ``linear_attn.conv1d``, ``A_log``,
                                                      ``dt_bias``, ``out_proj``
``attention.norm_weight``                             ``linear_attn.norm.weight``
``feed_forward.router``, ``w1[e] / w3[e] / w2[e]``    ``mlp.gate``, ``mlp.experts.e.gate_proj /
                                                      up_proj / down_proj`` (each transposed)
``feed_forward.shared.w1 / w3 / w2``, ``shared_gate``  ``mlp.shared_expert.*``,
                                                      ``mlp.shared_expert_gate``
====================================================  =============================================

plus the Llama names for the embeddings, the dense feed-forwards and the head. Qwen3-Next's
RMSNorms (block norms, final norm, QK-norm; not the gated norm of its linear layers) scale by
1 + weight: kiln's RMSNorm scales by its weight, so kiln holds weight + 1 (``Part.offset``). A
checkpoint's multi-token prediction weights (``mtp.*``) are not loaded, as transformers does
not load them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kiln.checkpointing.huggingface.families.common import block_problem, ends, layer_parts
from kiln.checkpointing.huggingface.parts import Part
from kiln.checkpointing.huggingface.rope import fail, rope_parameters, rope_table

FIELDS = frozenset([  # mapped or checked in model_table
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "rope_theta", "rope_scaling", "partial_rotary_factor", "attention_bias", "attention_dropout",
    "head_dim", "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "decoder_sparse_step",
    "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts_per_tok",
    "num_experts", "norm_topk_prob", "output_router_logits", "router_aux_loss_coef",
    "mlp_only_layers", "layer_types", "full_attention_interval",
    # in the released config.json files; transformers' Qwen3-Next code has no window, nor kiln's
    "use_sliding_window", "sliding_window",
])
KINDS = {"linear_attention": "linear", "full_attention": "full"}


def model_table(config: dict, source: str, ignore: tuple[str, ...]) -> dict[str, Any]:
    """The kiln ``[model]`` table equal to a Qwen3-Next config (CheckpointError otherwise)."""
    for name, want in {"hidden_act": "silu", "attention_dropout": 0.0}.items():
        if config.get(name, want) != want and name not in ignore:
            raise fail(source, name, f"{config[name]!r} is not supported (kiln: {want!r})")
    try:
        dim, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
    except KeyError as exc:
        raise fail(source, exc.args[0], "missing") from None
    eps = float(config.get("rms_norm_eps", 1e-6))
    attention = {"type": "causal", "n_heads": heads,
                 "n_kv_heads": int(config.get("num_key_value_heads") or heads),
                 "head_dim": int(config.get("head_dim") or 256), "qk_norm": True,
                 "qk_norm_eps": eps, "output_gate": True,
                 "bias": bool(config.get("attention_bias", False)),
                 "position": _rope(config, source)}
    linear = {"type": "gated_deltanet", "n_heads": int(config.get("linear_num_value_heads", 32)),
              "n_key_heads": int(config.get("linear_num_key_heads", 16)),
              "head_dim": int(config.get("linear_key_head_dim", 128)),
              "v_head_dim": int(config.get("linear_value_head_dim", 128)),
              "conv_size": int(config.get("linear_conv_kernel_dim", 4)), "norm_eps": eps}
    table: dict[str, Any] = {
        "type": "transformer", "dim": dim, "n_layers": layers,
        "vocab_size": int(config["vocab_size"]),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "init_std": float(config.get("initializer_range", 0.02)),
        "attention": attention, "norm": {"type": "rmsnorm", "eps": eps},
    }
    kinds = _layer_kinds(config, layers, source)
    if "linear" in kinds:
        table.update(layer_types=kinds, linear_attention=linear)
    swiglu = {"type": "swiglu", "hidden_dim": int(config.get("intermediate_size", 5632))}
    dense = _dense_layers(config, layers, source)
    if dense == layers:
        table["ffn"] = swiglu
        return table
    top_k = int(config.get("num_experts_per_tok", 10))
    norm_topk = bool(config.get("norm_topk_prob", True))
    if top_k == 1 and norm_topk:
        raise fail(source, "norm_topk_prob", "true with num_experts_per_tok = 1 (every gate 1) "
                   "is not supported: kiln keeps a single expert's score as its gate, so the "
                   "router learns")
    shared = int(config.get("shared_expert_intermediate_size", 512))
    if shared < 1:
        raise fail(source, "shared_expert_intermediate_size", f"{shared}: Qwen3-Next's MoE "
                   "layers always have a shared expert")
    table["ffn"] = {"type": "moe", "n_experts": int(config.get("num_experts", 512)),
                    "top_k": top_k, "hidden_dim": int(config.get("moe_intermediate_size", 512)),
                    "score": "softmax", "renormalize": norm_topk, "n_shared_experts": 1,
                    "shared_hidden_dim": shared, "shared_gate": True, "bias_update_coeff": 0.0}
    if dense:
        table.update(dense_layers=dense, dense_ffn=swiglu)
    return table


def _rope(config: dict, source: str) -> dict[str, Any]:
    """The full layers' position table: partial RoPE (``partial_rotary_factor``, in
    ``rope_parameters`` or at the top level of older configs; 0.25 when neither has it, as
    transformers defaults)."""
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = dict(config.get(key) or {})
    fraction = params.pop("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    table = rope_table({**config, key: params}, source)
    if float(fraction) != 1.0:
        table["fraction"] = float(fraction)
    return table


def _layer_kinds(config: dict, layers: int, source: str) -> list[str]:
    """kiln's ``layer_types``: the config's, or every ``full_attention_interval``-th layer full
    (transformers' default, 4)."""
    listed = config.get("layer_types")
    if listed is None:
        every = int(config.get("full_attention_interval", 4))
        listed = ["linear_attention" if (i + 1) % every else "full_attention"
                  for i in range(layers)]
    unknown = sorted(set(listed) - set(KINDS))
    if unknown or len(listed) != layers:
        raise fail(source, "layer_types", f"{listed!r}: one of {sorted(KINDS)} per layer "
                   f"({layers})")
    return [KINDS[k] for k in listed]


def _dense_layers(config: dict, layers: int, source: str) -> int:
    """How many leading layers have the dense MLP (all without experts): kiln's dense layers
    are the first ``model.dense_layers``, so ``mlp_only_layers`` must be 0..k-1."""
    if int(config.get("num_experts", 512)) <= 0:
        return layers
    step = int(config.get("decoder_sparse_step", 1))
    if step != 1:
        raise fail(source, "decoder_sparse_step", f"{step} is not supported (kiln: 1, every "
                   "layer past model.dense_layers has experts)")
    only = sorted(int(i) for i in config.get("mlp_only_layers") or [])
    if only != list(range(len(only))):
        raise fail(source, "mlp_only_layers", f"{only}: kiln's dense layers are the first "
                   "ones (model.dense_layers), so only [0, ..., k - 1] is supported")
    return min(len(only), layers)


def unused(name: str) -> bool:
    """A checkpoint tensor transformers does not load either: the multi-token prediction
    module."""
    return name.startswith("mtp.")


def is_qwen3_next(model: nn.Module) -> bool:
    """Whether the model is Qwen3-Next-shaped: a Gated DeltaNet layer or an output gate."""
    from kiln.components.attention.gated_deltanet import GatedDeltaNet

    return any(isinstance(b.attention, GatedDeltaNet) or hasattr(b.attention, "wg")
               for b in model.blocks())


def incompatibility(model: nn.Module) -> str:
    """Why a Qwen3-Next-shaped model (``is_qwen3_next``) has no Qwen3-Next layout ("" if it
    has)."""
    from kiln.components.attention.causal import CausalAttention
    from kiln.components.attention.gated_deltanet import GatedDeltaNet
    from kiln.components.positions.rope import RoPE

    eps, settings = model.norm.eps, set()
    for i, block in enumerate(model.blocks()):
        attn = block.attention
        if isinstance(attn, GatedDeltaNet):
            if attn.norm_eps != eps:
                return "Qwen3-Next layout: the linear layers' gated norm eps must be the model's"
            settings.add(("linear", attn.n_heads, attn.n_key_heads, attn.head_dim,
                          attn.v_head_dim, attn.conv_size))
        elif type(attn) is CausalAttention:
            if hasattr(attn, "wqkv"):
                return "Qwen3-Next layout: a fused wqkv (its q_proj holds query and gate)"
            bias = attn.wq.bias is not None
            if (not hasattr(attn, "wg") or attn.q_norm is None or attn.sinks is not None
                    or attn.window or attn.q_scale != 1.0 or type(attn.position) is not RoPE
                    or bias != (attn.wo.bias is not None) or attn.q_norm.eps != eps):
                return ("Qwen3-Next layout: full layers of causal attention with the output "
                        "gate, QK-norm (the model's eps) and RoPE, biases on all of q/k/v/o or "
                        "none; no sinks, window or µP query scale")
            rope = attn.position.cfg
            settings.add(("full", attn.n_heads, attn.n_kv_heads, attn.head_dim, bias,
                          rope.model_dump_json()))
        else:
            return f"Qwen3-Next layout: layer {i} attention is {type(attn).__name__}"
        problem = block_problem(block, eps, "Qwen3-Next layout: ")
        if problem:
            return problem
    if len({s for s in settings if s[0] == "full"}) > 1 or len(
            {s for s in settings if s[0] == "linear"}) > 1:
        return "Qwen3-Next layout: layers of different attention settings"
    return _ffn_problem(model)


def _ffn_problem(model: nn.Module) -> str:
    """Why the feed-forwards have no Qwen3-Next layout: dense SwiGLUs first, then MoE layers
    of softmax gates with a gated shared expert, all alike."""
    from kiln.components.ffn.moe import MoE
    from kiln.components.ffn.swiglu import SwiGLU

    blocks = model.blocks()
    kinds = [type(b.feed_forward) for b in blocks]
    dense = kinds.index(MoE) if MoE in kinds else len(kinds)
    if any(k is not SwiGLU for k in kinds[:dense]) or any(k is not MoE for k in kinds[dense:]):
        return "Qwen3-Next layout: SwiGLU layers, then MoE layers, nothing else"
    moes = set()
    for f in (b.feed_forward for b in blocks[dense:]):
        c = f.cfg
        if (c.score != "softmax" or c.capacity_factor or c.n_groups > 1 or c.route_scale != 1.0
                or c.router_bias or c.experts != "swiglu" or f.shared is None
                or not c.shared_gate):
            return ("Qwen3-Next layout: MoE layers need softmax gates, no capacity limit, "
                    "groups, route scale or router bias, SwiGLU experts and a shared expert "
                    "with shared_gate")
        moes.add((f.n_experts, f.top_k, f.hidden_dim, f.shared.hidden_dim,
                  c.renormalize and f.top_k > 1))
    if len(moes) > 1 or len({b.feed_forward.hidden_dim for b in blocks[:dense]}) > 1:
        return "Qwen3-Next layout: layers of different feed-forward settings"
    return ""


def _full_parts(attn: nn.Module, kn: str, hf: str) -> dict[str, list[Part]]:
    """A full layer: q_proj holds, per head, the query's rows, then the gate's."""
    h, hk, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    r = attn.position.rotated
    a, s = kn + "attention.", hf + "self_attn."
    out: dict[str, list[Part]] = {}
    kinds = ("weight", "bias") if attn.wo.bias is not None else ("weight",)
    for kind in kinds:
        q = f"{s}q_proj.{kind}"
        out[f"{a}wq.{kind}"] = [Part(q, d, 1, start=2 * i * d, rope_dim=r) for i in range(h)]
        out[f"{a}wg.{kind}"] = [Part(q, d, start=(2 * i + 1) * d) for i in range(h)]
        out[f"{a}wk.{kind}"] = [Part(f"{s}k_proj.{kind}", hk * d, hk, rope_dim=r)]
        out[f"{a}wv.{kind}"] = [Part(f"{s}v_proj.{kind}", hk * d)]
        out[f"{a}wo.{kind}"] = [Part(f"{s}o_proj.{kind}", attn.wo.out_features)]
    for n in ("q_norm", "k_norm"):
        out[f"{a}{n}.weight"] = [Part(f"{s}{n}.weight", d, 1, rope_dim=r, offset=1.0)]
    return out


def _linear_parts(attn: nn.Module, kn: str, hf: str) -> dict[str, list[Part]]:
    """A Gated DeltaNet layer: in_proj_qkvz and in_proj_ba group their rows per key head."""
    hk, dk = attn.n_key_heads, attn.head_dim
    group = attn.n_heads // hk
    vz = group * attn.v_head_dim  # one key head's value (and gate) rows
    block = 2 * dk + 2 * vz
    a, s = kn + "attention.", hf + "linear_attn."
    qkvz, ba = s + "in_proj_qkvz.weight", s + "in_proj_ba.weight"
    out = {f"{a}{name}.weight": [Part(qkvz, rows, start=g * block + at) for g in range(hk)]
           for name, rows, at in (("wq", dk, 0), ("wk", dk, dk), ("wv", vz, 2 * dk),
                                  ("wz", vz, 2 * dk + vz))}
    out.update({f"{a}{name}.weight": [Part(ba, group, start=g * 2 * group + at)
                                      for g in range(hk)]
                for name, at in (("wb", 0), ("wa", group))})
    out.update({a + "conv": [Part(s + "conv1d.weight", attn.conv.shape[0])],
                a + "A_log": [Part(s + "A_log", attn.n_heads)],
                a + "dt_bias": [Part(s + "dt_bias", attn.n_heads)],
                a + "norm_weight": [Part(s + "norm.weight", attn.v_head_dim)],
                a + "wo.weight": [Part(s + "out_proj.weight", attn.wo.out_features)]})
    return out


def parts(model: nn.Module) -> dict[str, list[Part]]:
    """kiln state-dict name -> the Qwen3-Next tensors it is made of (module docstring)."""
    out = ends(model, norm_offset=1.0)
    for i, block in enumerate(model.blocks()):
        kn, hf = f"layers.{i}.", f"model.layers.{i}."
        attn, ffn = block.attention, block.feed_forward
        out.update((_full_parts if hasattr(attn, "wg") else _linear_parts)(attn, kn, hf))
        out.update(layer_parts(ffn, kn, hf, model.dim, "shared_expert", norm_offset=1.0))
        if hasattr(ffn, "router"):
            out[f"{kn}feed_forward.shared_gate.weight"] = [
                Part(hf + "mlp.shared_expert_gate.weight", 1)]
    return out


def hf_config(model: nn.Module, tokenizer) -> dict[str, Any]:
    """config.json of a kiln transformer with the Qwen3-Next layout."""
    from kiln.components.attention.gated_deltanet import GatedDeltaNet

    blocks = model.blocks()
    full = next((b.attention for b in blocks if hasattr(b.attention, "wg")), None)
    linear = next((b.attention for b in blocks if isinstance(b.attention, GatedDeltaNet)), None)
    moe = next((b.feed_forward for b in blocks if hasattr(b.feed_forward, "router")), None)
    dense = [b.feed_forward for b in blocks if not hasattr(b.feed_forward, "router")]
    config: dict[str, Any] = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
        "vocab_size": model.vocab_size, "hidden_size": model.dim,
        "num_hidden_layers": len(blocks), "hidden_act": "silu",
        "intermediate_size": dense[0].hidden_dim if dense else moe.hidden_dim,
        "rms_norm_eps": model.norm.eps, "tie_word_embeddings": bool(model.tied),
        "initializer_range": model.init_std, "max_position_embeddings": model.max_seq_len,
        "attention_dropout": 0.0, "use_cache": True,
        "layer_types": ["linear_attention" if isinstance(b.attention, GatedDeltaNet)
                        else "full_attention" for b in blocks],
        "bos_token_id": getattr(tokenizer, "bos_id", None),
        "eos_token_id": getattr(tokenizer, "eos_id", None),
        "pad_token_id": getattr(tokenizer, "pad_id", None),
        "dtype": str(model.tok_embeddings.weight.dtype).removeprefix("torch."),
    }
    if full is not None:
        attn, rope = full, full.position.cfg
        config["max_position_embeddings"] = max(model.max_seq_len, int(
            rope.original_max_seq_len * rope.factor))
        config.update(num_attention_heads=attn.n_heads, num_key_value_heads=attn.n_kv_heads,
                      head_dim=attn.head_dim, attention_bias=attn.wo.bias is not None,
                      rope_parameters={**rope_parameters(rope),
                                       "partial_rotary_factor": rope.fraction})
    if linear is not None:
        config.update(linear_num_value_heads=linear.n_heads,
                      linear_num_key_heads=linear.n_key_heads,
                      linear_key_head_dim=linear.head_dim,
                      linear_value_head_dim=linear.v_head_dim,
                      linear_conv_kernel_dim=linear.conv_size)
    if moe is None:
        config["num_experts"] = 0
    else:
        config.update(num_experts=moe.n_experts, num_experts_per_tok=moe.top_k,
                      moe_intermediate_size=moe.hidden_dim,
                      shared_expert_intermediate_size=moe.shared.hidden_dim,
                      norm_topk_prob=moe.cfg.renormalize and moe.top_k > 1,
                      decoder_sparse_step=1, mlp_only_layers=list(range(len(dense))))
    return config

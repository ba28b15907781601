"""Which Hugging Face tensors make up each kiln parameter (Llama / Qwen2 / Qwen3 layout; GPT-2's
is ``gpt2``, DeepSeek-V3's ``deepseek``, Qwen3-Next's ``qwen3_next``).

================================================  ==================================================
kiln (torchtitan names)                           Hugging Face
================================================  ==================================================
``tok_embeddings.weight``                         ``model.embed_tokens.weight``
``layers.N.attention.wq`` (RoPE perm.), bias      ``model.layers.N.self_attn.q_proj``
``layers.N.attention.wk`` (RoPE perm.), bias      ``model.layers.N.self_attn.k_proj``
``layers.N.attention.wv``, bias                   ``model.layers.N.self_attn.v_proj``
``layers.N.attention.wqkv`` (kv-grouped rows)     ``q_proj``, ``k_proj``, ``v_proj`` interleaved
``layers.N.attention.wo``, bias                   ``model.layers.N.self_attn.o_proj``
``layers.N.attention.q_norm/k_norm`` (perm.)      ``model.layers.N.self_attn.q_norm/k_norm`` (Qwen3)
``layers.N.attention_norm.weight``                ``model.layers.N.input_layernorm.weight``
``layers.N.ffn_norm.weight``                      ``model.layers.N.post_attention_layernorm.weight``
``layers.N.feed_forward.w1 / w3 / w2``            ``model.layers.N.mlp.gate/up/down_proj.weight``
``norm.weight``                                   ``model.norm.weight``
``output.weight`` (absent when tied)              ``lm_head.weight``
================================================  ==================================================

kiln's RoPE rotates adjacent feature pairs (2i, 2i+1) of a head; Hugging Face's pairs i with
i + head_dim/2. The rows of wq and wk (their biases, and the QK-norm weights) are permuted per
head between the two layouts (``to_hf`` / ``from_hf``). A fused ``wqkv`` groups its rows per
key/value head (that head's query heads, its key, its value: ``causal.split_fused_rows``), so each
Hugging Face projection is spread over the groups: a ``Part`` names the rows ``start`` onwards of
its Hugging Face tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.checkpointing.huggingface.families import deepseek, gpt2, qwen3_next
from kiln.checkpointing.huggingface.families.common import block_problem
from kiln.checkpointing.huggingface.parts import Part
from kiln.components.adapter_contract import adapter_parameter_names
from kiln.parallelisms.blocks import clean_name


def hf_incompatibility(model: nn.Module) -> str:
    """Why the model has no Hugging Face Llama / Qwen2 / Qwen3 / GPT-2 / DeepSeek-V3 layout
    ("" if it has one)."""
    from kiln.components.attention.causal import CausalAttention
    from kiln.components.ffn.swiglu import SwiGLU
    from kiln.components.models.transformer import Transformer
    from kiln.components.norms.rmsnorm import RMSNorm
    from kiln.components.positions.rope import RoPE

    if not isinstance(model, Transformer):  # FSDP2 makes the class a subclass
        return f"model is {type(model).__name__}, not the dense transformer"
    if model.logit_softcap:
        return "logit soft-capping"
    if model.width_multiplier() != 1.0:
        return "µP's output multiplier (model.parametrization = \"mup\" at dim != base_dim)"
    if model.pos_embeddings is not None:  # GPT-2's learned positions
        return gpt2.incompatibility(model)
    if type(model.norm) is not RMSNorm or model.norm.weight is None:
        return "final norm is not RMSNorm with a weight"
    if qwen3_next.is_qwen3_next(model):  # Gated DeltaNet layers or gated attention
        return qwen3_next.incompatibility(model)
    ropes = [b.attention.position for b in model.blocks()
             if isinstance(getattr(b.attention, "position", None), RoPE)]
    if any(r.rotated != r.head_dim for r in ropes):
        return "partial RoPE (position.fraction < 1): only Qwen3-Next's layout has it"
    if hasattr(model.blocks()[0].attention, "wkv_b"):  # latent attention: DeepSeek-V3's
        return deepseek.incompatibility(model)
    if hasattr(model.blocks()[0].feed_forward, "w13"):  # gpt-oss's experts
        return _gpt_oss_problem(model)
    eps = model.norm.eps
    for i, block in enumerate(model.blocks()):
        attn, ffn = block.attention, block.feed_forward
        if type(attn) is not CausalAttention:
            return f"layer {i} attention is {type(attn).__name__}"
        if attn.q_scale != 1.0:
            return "µP's attention scale (model.base_head_dim)"
        if attn.sinks is not None:
            return "attention sinks (gpt-oss's; no Llama / Qwen layout)"
        if type(attn.position) is not RoPE:
            return f"position encoding {type(attn.position).__name__}"
        if type(ffn) is not SwiGLU:
            return f"layer {i} feed-forward is {type(ffn).__name__}"
        problem = block_problem(block, eps)
        if problem:
            return problem
        out_bias = attn.wo.bias is not None
        in_bias = (attn.wqkv if hasattr(attn, "wqkv") else attn.wq).bias is not None
        if out_bias and not in_bias:
            return "a bias on the output projection only"
        if attn.q_norm is not None:
            if in_bias and not out_bias:
                return "QK-norm with q/k/v-only biases (Qwen3 biases all four projections)"
            if attn.q_norm.eps != eps or attn.q_norm.weight is None:
                return "QK-norm whose eps differs from the model norm's (Qwen3 shares one)"
    return _window_problem(model)


def _gpt_oss_problem(model: nn.Module) -> str:
    """Why a model with gpt-oss's experts has no gpt-oss layout ("" if it has one)."""
    from kiln.components.attention.causal import CausalAttention
    from kiln.components.positions.rope import RoPE

    eps, settings = model.norm.eps, set()
    for block in model.blocks():
        attn, ffn = block.attention, block.feed_forward
        if (type(attn) is not CausalAttention or hasattr(attn, "wqkv") or attn.sinks is None
                or attn.wq.bias is None or attn.wo.bias is None or attn.q_norm is not None
                or hasattr(attn, "wg") or attn.q_scale != 1.0
                or type(attn.position) is not RoPE):
            return ("gpt-oss layout: causal attention with sinks, biases on q/k/v/o, RoPE, no "
                    "QK-norm, output gate or fused wqkv")
        if not hasattr(ffn, "w13") or ffn.router.bias is None or ffn.shared is not None:
            return "gpt-oss layout: every layer gpt-oss's experts with a router bias, no shared"
        c = ffn.cfg
        settings.add((c.n_experts, c.top_k, ffn.hidden_dim, c.swiglu_limit, c.swiglu_alpha))
        if (c.score != "softmax" or not c.renormalize or c.route_scale != 1.0 or c.n_groups > 1
                or c.capacity_factor):
            return ("gpt-oss layout: softmax gates renormalised over the top k, no scale, "
                    "groups or capacity limit")
        problem = block_problem(block, eps, "gpt-oss layout: ")
        if problem:
            return problem
    if len(settings) > 1:
        return "gpt-oss layout: layers of different expert settings"
    sizes = {b.attention.window for b in model.blocks()} - {0}
    return f"sliding windows of several sizes ({sorted(sizes)})" if len(sizes) > 1 else ""


def _window_problem(model: nn.Module) -> str:
    """Why the model's sliding windows have no Hugging Face config ("" if they have one):
    Mistral windows every layer (and has no attention biases); Qwen2 / Qwen3 name each layer's
    kind (``layer_types``); one window size in all of them."""
    windows = [b.attention.window for b in model.blocks()]
    sizes = set(windows) - {0}
    if not sizes:
        return ""
    if len(sizes) > 1:
        return f"sliding windows of several sizes ({sorted(sizes)})"
    attn = model.blocks()[0].attention
    qkv_bias = (attn.wqkv if hasattr(attn, "wqkv") else attn.wq).bias is not None
    if attn.q_norm is not None or (qkv_bias and attn.wo.bias is None):
        return ""  # Qwen3 / Qwen2: layer_types
    if 0 in windows:
        return ("sliding-window layers beside full ones in a Llama layout (Mistral windows "
                "every layer; Qwen2 / Qwen3 name each layer's kind)")
    if qkv_bias or attn.wo.bias is not None:
        return "a sliding window with attention biases (Mistral has none)"
    return ""


def _attention_parts(attn: nn.Module, p: str, kn: str, kind: str) -> dict[str, list[Part]]:
    """q/k/v of one layer (Hugging Face prefix ``p``, kiln prefix ``kn``); kind: weight, bias."""
    hq, hk, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    q = Part(f"{p}self_attn.q_proj.{kind}", hq * d, hq)
    k = Part(f"{p}self_attn.k_proj.{kind}", hk * d, hk)
    v = Part(f"{p}self_attn.v_proj.{kind}", hk * d)
    k_prefix = kn + "attention."
    if hasattr(attn, "wqkv"):  # per kv head g: its query heads, its key, its value
        group = hq // hk
        return {f"{k_prefix}wqkv.{kind}": [
            part for g in range(hk) for part in (
                Part(q.hf_name, group * d, group, g * group * d),
                Part(k.hf_name, d, 1, g * d), Part(v.hf_name, d, 0, g * d))]}
    return {f"{k_prefix}wq.{kind}": [q], f"{k_prefix}wk.{kind}": [k], f"{k_prefix}wv.{kind}": [v]}


def parts(model: nn.Module) -> dict[str, list[Part]]:
    """kiln state-dict name (wrapper prefixes removed) -> the Hugging Face tensors it is made
    of, stacked along dim 0. Only for a model with a Hugging Face layout."""
    if getattr(model, "pos_embeddings", None) is not None:
        return gpt2.parts(model)
    if hasattr(model.blocks()[0].attention, "wkv_b"):
        return deepseek.parts(model)
    if qwen3_next.is_qwen3_next(model):
        return qwen3_next.parts(model)
    out: dict[str, list[Part]] = {
        "tok_embeddings.weight": [Part("model.embed_tokens.weight", model.vocab_size)],
    }
    dim = model.dim
    for i, block in enumerate(model.blocks()):
        attn, ffn = block.attention, block.feed_forward
        hf, kn = f"model.layers.{i}.", f"layers.{i}."
        out.update(_attention_parts(attn, hf, kn, "weight"))
        if (attn.wqkv if hasattr(attn, "wqkv") else attn.wq).bias is not None:
            out.update(_attention_parts(attn, hf, kn, "bias"))
        out[kn + "attention.wo.weight"] = [Part(hf + "self_attn.o_proj.weight", dim)]
        if attn.wo.bias is not None:
            out[kn + "attention.wo.bias"] = [Part(hf + "self_attn.o_proj.bias", dim)]
        if attn.q_norm is not None:
            d = attn.head_dim
            out[kn + "attention.q_norm.weight"] = [Part(hf + "self_attn.q_norm.weight", d, 1)]
            out[kn + "attention.k_norm.weight"] = [Part(hf + "self_attn.k_norm.weight", d, 1)]
        out[kn + "attention_norm.weight"] = [Part(hf + "input_layernorm.weight", dim)]
        out[kn + "ffn_norm.weight"] = [Part(hf + "post_attention_layernorm.weight", dim)]
        if attn.sinks is not None:  # gpt-oss
            out[kn + "attention.sinks"] = [Part(hf + "self_attn.sinks", attn.n_heads)]
        if hasattr(ffn, "w13"):  # gpt-oss's experts: transformers' very layout
            e, f = ffn.n_experts, kn + "feed_forward."
            out.update({f + "router.weight": [Part(hf + "mlp.router.weight", e)],
                        f + "router.bias": [Part(hf + "mlp.router.bias", e)],
                        f + "w13": [Part(hf + "mlp.experts.gate_up_proj", e)],
                        f + "b13": [Part(hf + "mlp.experts.gate_up_proj_bias", e)],
                        f + "w2": [Part(hf + "mlp.experts.down_proj", e)],
                        f + "b2": [Part(hf + "mlp.experts.down_proj_bias", e)]})
            continue
        h = ffn.hidden_dim
        out[kn + "feed_forward.w1.weight"] = [Part(hf + "mlp.gate_proj.weight", h)]
        out[kn + "feed_forward.w3.weight"] = [Part(hf + "mlp.up_proj.weight", h)]
        out[kn + "feed_forward.w2.weight"] = [Part(hf + "mlp.down_proj.weight", dim)]
    out["norm.weight"] = [Part("model.norm.weight", dim)]
    if not model.tied:
        out["output.weight"] = [Part("lm_head.weight", model.vocab_size)]
    return out


def kept_at_init(name: str, layout: dict[str, list[Part]]) -> bool:
    """A kiln tensor the Hugging Face ``layout`` has no place for, left out of an export and
    at its initialisation by an import: multi-token prediction modules, and the balancing bias
    of experts whose family has none (gpt-oss)."""
    return name not in layout and (name.startswith("mtp.")
                                   or name.endswith("feed_forward.expert_bias"))


def identity_parts(model: nn.Module) -> dict[str, list[Part]]:
    """kiln's own layout: every distinct parameter and persistent buffer under its own name."""
    return {name: [Part(name, t.shape[0] if t.dim() else 1)] for name, t in tensors(model).items()}


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Distinct parameters (a tied one once, under its first name) and persistent buffers, by
    clean name, in the state dict's order."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    adapters = adapter_parameter_names(model)  # merged or exported on their own
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen or name in adapters:
            continue
        seen.add(id(t))
        out[clean_name(name)] = t
    return out

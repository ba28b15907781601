"""GPT-2 (Radford et al. 2019) in Hugging Face's layout: its ``config.json`` <-> kiln's
``[model]`` table, and which of its tensors make up each kiln parameter.

====================================================  =============================================
kiln                                                  Hugging Face (``GPT2LMHeadModel``)
====================================================  =============================================
``tok_embeddings.weight``                             ``transformer.wte.weight``
``pos_embeddings.weight``                             ``transformer.wpe.weight``
``layers.N.attention_norm.weight / bias``             ``transformer.h.N.ln_1.weight / bias``
``layers.N.attention.wq / wk / wv``, biases           ``transformer.h.N.attn.c_attn`` (thirds)
``layers.N.attention.wo``, bias                       ``transformer.h.N.attn.c_proj``
``layers.N.ffn_norm.weight / bias``                   ``transformer.h.N.ln_2.weight / bias``
``layers.N.feed_forward.w1 / w2``, biases             ``transformer.h.N.mlp.c_fc / c_proj``
``norm.weight / bias``                                ``transformer.ln_f.weight / bias``
``output.weight`` (absent when tied)                  ``lm_head.weight``
====================================================  =============================================

GPT-2's ``Conv1D`` stores a weight as (in, out), the transpose of ``nn.Linear``'s, so every
matrix part is ``transposed``; ``c_attn`` holds q, k and v side by side in its columns. OpenAI's
own checkpoints name the tensors without the ``transformer.`` prefix and store each layer's
causal mask (``attn.bias``); the importer reads both forms (``importer.load_weights``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from kiln.checkpointing.huggingface.parts import Part
from kiln.components.errors import CheckpointError

# Hugging Face activation_function -> kiln's mlp activation ("gelu_new" is the tanh form)
ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
               "relu": "relu"}
EXPORTED = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}
FIELDS = frozenset([  # mapped or checked in model_table
    "vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner",
    "activation_function", "resid_pdrop", "embd_pdrop", "attn_pdrop", "layer_norm_epsilon",
    "initializer_range", "scale_attn_weights", "scale_attn_by_inverse_layer_idx",
    "reorder_and_upcast_attn", "add_cross_attention", "tie_word_embeddings",
])
# GPT2DoubleHeadsModel's classification head: not part of the language model
SUMMARY = frozenset(["summary_type", "summary_use_proj", "summary_activation",
                     "summary_proj_to_labels", "summary_first_dropout"])


def _fail(source: str, field: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{source}: config.json field {field!r}: {problem}")


def model_table(config: dict, source: str, ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    """The kiln ``[model]`` table equal to a GPT-2 config (CheckpointError otherwise); fields
    outside FIELDS were checked by the caller (``config.model_table``)."""
    checks = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
              "reorder_and_upcast_attn": False, "add_cross_attention": False}
    for name, want in checks.items():
        if config.get(name, want) != want and name not in ignore:
            raise _fail(source, name, f"{config[name]!r} is not supported (kiln: {want!r})")
    act = config.get("activation_function", "gelu_new")
    if act not in ACTIVATIONS:
        raise _fail(source, "activation_function", f"{act!r} is not supported (kiln: "
                    f"{', '.join(ACTIVATIONS)})")
    resid, embd = float(config.get("resid_pdrop", 0.1)), float(config.get("embd_pdrop", 0.1))
    if resid != embd and "embd_pdrop" not in ignore:
        raise _fail(source, "embd_pdrop", f"{embd} differs from resid_pdrop = {resid}; kiln's "
                    "model.dropout is one rate for both")
    try:
        dim, heads = int(config["n_embd"]), int(config["n_head"])
        layers, vocab = int(config["n_layer"]), int(config["vocab_size"])
        positions = int(config.get("n_positions") or config["n_ctx"])
    except KeyError as exc:
        raise _fail(source, exc.args[0], "missing") from None
    if dim % heads:
        raise _fail(source, "n_head", f"{heads} does not divide n_embd = {dim}")
    eps = float(config.get("layer_norm_epsilon", 1e-5))
    return {
        "type": "transformer", "dim": dim, "n_layers": layers, "vocab_size": vocab,
        "max_seq_len": positions, "absolute_positions": True,
        "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
        "dropout": resid, "init_std": float(config.get("initializer_range", 0.02)),
        "attention": {"type": "causal", "n_heads": heads, "n_kv_heads": heads, "bias": True,
                      "dropout": float(config.get("attn_pdrop", 0.1)),
                      "position": {"type": "none"}},
        "ffn": {"type": "mlp", "hidden_dim": int(config.get("n_inner") or 4 * dim),
                "activation": ACTIVATIONS[act], "bias": True},
        "norm": {"type": "layernorm", "eps": eps},
    }


def incompatibility(model: nn.Module) -> str:
    """Why a transformer with learned absolute positions has no GPT-2 layout ("" if it has)."""
    from kiln.components.attention.causal import CausalAttention
    from kiln.components.ffn.mlp import MLP
    from kiln.components.norms.layernorm import LayerNorm
    from kiln.components.positions.nope import NoPosition

    norms = [model.norm, *(n for b in model.blocks() for n in (b.attention_norm, b.ffn_norm))]
    if any(type(n) is not LayerNorm or n.weight is None or n.bias is None for n in norms):
        return "GPT-2 layout: norms other than LayerNorm with a weight and a bias"
    if len({n.eps for n in norms}) > 1:
        return "GPT-2 layout: LayerNorms with different eps"
    first = model.blocks()[0]
    for i, block in enumerate(model.blocks()):
        attn, ffn = block.attention, block.feed_forward
        if type(attn) is not CausalAttention or hasattr(attn, "wqkv"):
            return f"GPT-2 layout: layer {i} attention is not causal with separate wq/wk/wv"
        if type(attn.position) is not NoPosition:
            return "GPT-2 layout: a position encoding inside attention (GPT-2 has none)"
        if (attn.n_kv_heads != attn.n_heads or attn.head_dim * attn.n_heads != model.dim
                or attn.q_norm is not None or attn.window or attn.sinks is not None
                or hasattr(attn, "wg") or attn.q_scale != 1.0):
            return ("GPT-2 layout: grouped-query heads, a head width other than dim / n_heads, "
                    "QK-norm, a window, sinks or an output gate")
        if attn.wq.bias is None or attn.wo.bias is None:
            return "GPT-2 layout: attention without biases"
        if type(ffn) is not MLP or ffn.w1.bias is None or ffn.activation not in EXPORTED:
            return f"GPT-2 layout: layer {i} feed-forward is not a biased gelu / relu MLP"
        if (ffn.hidden_dim != first.feed_forward.hidden_dim
                or attn.dropout_p != first.attention.dropout_p):
            return "GPT-2 layout: layers of different widths or attention dropouts"
        if block.attention_scale is not None:
            return "LayerScale"
    return ""


def parts(model: nn.Module) -> dict[str, list[Part]]:
    """kiln state-dict name -> the GPT-2 tensors it is made of (module docstring)."""
    dim, t = model.dim, "transformer."
    out: dict[str, list[Part]] = {
        "tok_embeddings.weight": [Part(t + "wte.weight", model.vocab_size)],
        "pos_embeddings.weight": [Part(t + "wpe.weight", model.max_seq_len)],
    }
    for i, block in enumerate(model.blocks()):
        kn, hf = f"layers.{i}.", f"{t}h.{i}."
        hidden = block.feed_forward.hidden_dim
        for norm, name in (("attention_norm", "ln_1"), ("ffn_norm", "ln_2")):
            for leaf in ("weight", "bias"):
                out[f"{kn}{norm}.{leaf}"] = [Part(f"{hf}{name}.{leaf}", dim)]
        for j, proj in enumerate(("wq", "wk", "wv")):
            out[f"{kn}attention.{proj}.weight"] = [
                Part(hf + "attn.c_attn.weight", dim, start=j * dim, transposed=True)]
            out[f"{kn}attention.{proj}.bias"] = [Part(hf + "attn.c_attn.bias", dim,
                                                      start=j * dim)]
        for kiln_name, hf_name, rows in (("attention.wo", "attn.c_proj", dim),
                                         ("feed_forward.w1", "mlp.c_fc", hidden),
                                         ("feed_forward.w2", "mlp.c_proj", dim)):
            out[f"{kn}{kiln_name}.weight"] = [Part(f"{hf}{hf_name}.weight", rows,
                                                   transposed=True)]
            out[f"{kn}{kiln_name}.bias"] = [Part(f"{hf}{hf_name}.bias", rows)]
    out["norm.weight"] = [Part(t + "ln_f.weight", dim)]
    out["norm.bias"] = [Part(t + "ln_f.bias", dim)]
    if not model.tied:
        out["output.weight"] = [Part("lm_head.weight", model.vocab_size)]
    return out


def hf_config(model: nn.Module, tokenizer) -> dict[str, Any]:
    """config.json of a kiln transformer with the GPT-2 layout (``incompatibility`` empty)."""
    block = model.blocks()[0]
    dropout = model.embed_dropout.p if model.embed_dropout is not None else 0.0
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": model.vocab_size, "n_positions": model.max_seq_len, "n_embd": model.dim,
        "n_layer": len(model.blocks()), "n_head": block.attention.n_heads,
        "n_inner": block.feed_forward.hidden_dim,
        "activation_function": EXPORTED[block.feed_forward.activation],
        "resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": block.attention.dropout_p,
        "layer_norm_epsilon": model.norm.eps, "initializer_range": model.init_std,
        "scale_attn_weights": True, "tie_word_embeddings": bool(model.tied),
        "bos_token_id": getattr(tokenizer, "bos_id", None),
        "eos_token_id": getattr(tokenizer, "eos_id", None),
        "pad_token_id": getattr(tokenizer, "pad_id", None), "use_cache": True,
        "dtype": str(model.tok_embeddings.weight.dtype).removeprefix("torch."),
    }

"""The pieces of a layout the MoE families share: each layer's norms and feed-forward (a dense
SwiGLU, or one tensor per expert, transposed, beside a shared expert) under Hugging Face's
``model.layers.N.`` names, and the embeddings, final norm and head."""

from __future__ import annotations

from torch import nn

from kiln.checkpointing.huggingface.parts import Part

MATS = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def layer_parts(ffn: nn.Module, kn: str, hf: str, dim: int, shared: str,
                norm_offset: float = 0.0) -> dict[str, list[Part]]:
    """Layer ``kn`` (Hugging Face prefix ``hf``)'s block norms and feed-forward; ``shared``:
    the Hugging Face name of the shared expert (``shared_experts``, ``shared_expert``)."""
    out = {kn + "attention_norm.weight": [Part(hf + "input_layernorm.weight", dim,
                                               offset=norm_offset)],
           kn + "ffn_norm.weight": [Part(hf + "post_attention_layernorm.weight", dim,
                                         offset=norm_offset)]}
    f, m = kn + "feed_forward.", hf + "mlp."
    if not hasattr(ffn, "router"):  # a dense layer
        for ours, theirs in MATS:
            rows = dim if ours == "w2" else ffn.hidden_dim
            out[f"{f}{ours}.weight"] = [Part(f"{m}{theirs}.weight", rows)]
        return out
    out[f + "router.weight"] = [Part(m + "gate.weight", ffn.n_experts)]
    for ours, theirs in MATS:
        out[f + ours] = [Part(f"{m}experts.{e}.{theirs}.weight", 1, transposed=True)
                         for e in range(ffn.n_experts)]
        rows = dim if ours == "w2" else ffn.shared.hidden_dim
        out[f"{f}shared.{ours}.weight"] = [Part(f"{m}{shared}.{theirs}.weight", rows)]
    return out


def ends(model: nn.Module, norm_offset: float = 0.0) -> dict[str, list[Part]]:
    """The embeddings, the final norm and (untied) the head."""
    out = {"tok_embeddings.weight": [Part("model.embed_tokens.weight", model.vocab_size)],
           "norm.weight": [Part("model.norm.weight", model.dim, offset=norm_offset)]}
    if not model.tied:
        out["output.weight"] = [Part("lm_head.weight", model.vocab_size)]
    return out


def block_problem(block: nn.Module, eps: float, layout: str = "") -> str:
    """Why a block's norms or LayerScale have no place in a Hugging Face layout ("" if none):
    every family wants RMSNorms with a weight and the final norm's eps, and no LayerScale.
    ``layout``: the message's prefix naming the family's layout."""
    from kiln.components.norms.rmsnorm import RMSNorm

    if block.attention_scale is not None:
        return "LayerScale"
    norms = (block.attention_norm, block.ffn_norm)
    if any(type(n) is not RMSNorm or n.weight is None or n.eps != eps for n in norms):
        return f"{layout}block norms other than RMSNorm with a weight and the final norm's eps"
    return ""

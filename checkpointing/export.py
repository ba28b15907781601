"""``kiln export``: a checkpoint's model as consolidated safetensors + config.json + recipe.toml.

Two layouts:

- ``kiln``: the model's own parameter names (torchtitan's), ``config.json`` holding the model
  table of the recipe. Works for every registered model.
- ``hf``: for the dense ``transformer`` with standard causal attention, RoPE, SwiGLU and RMSNorm
  (no QK-norm, LayerScale or logit soft-capping) a Hugging Face ``LlamaForCausalLM`` layout,
  loadable with ``transformers``' ``from_pretrained``. ``auto`` picks ``hf`` when it applies.

Llama mapping (kiln -> Hugging Face):

==============================================  ===============================================
``tok_embeddings.weight``                       ``model.embed_tokens.weight``
``layers.N.attention.wq.weight`` (RoPE perm.)   ``model.layers.N.self_attn.q_proj.weight``
``layers.N.attention.wk.weight`` (RoPE perm.)   ``model.layers.N.self_attn.k_proj.weight``
``layers.N.attention.wv.weight``                ``model.layers.N.self_attn.v_proj.weight``
``layers.N.attention.wo.weight``                ``model.layers.N.self_attn.o_proj.weight``
``layers.N.attention_norm.weight``              ``model.layers.N.input_layernorm.weight``
``layers.N.ffn_norm.weight``                    ``model.layers.N.post_attention_layernorm.weight``
``layers.N.feed_forward.w1/w3/w2.weight``       ``model.layers.N.mlp.gate_proj/up_proj/down_proj``
``norm.weight``                                 ``model.norm.weight``
``output.weight`` (absent when tied)            ``lm_head.weight``
==============================================  ===============================================

kiln's RoPE rotates adjacent feature pairs (2i, 2i+1) of a head; Hugging Face's pairs i with
i + head_dim/2. The rows of wq and wk (and their biases) are permuted per head accordingly.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kiln.checkpointing.storage import save_safetensors
from kiln.components.errors import CheckpointError, RecipeError

EXPORT_FILES = ("config.json", "model.safetensors", "recipe.toml")  # what an export writes


def export(model: torch.nn.Module, tokenizer, out_dir: str | Path, *, model_table: dict,
           recipe_file: Path, fmt: str = "auto", force: bool = False) -> dict[str, Any]:
    """Write ``model`` (whole, on the CPU) to ``out_dir``; returns a summary (layout, file
    names, tensor count). ``model_table`` is the recipe's resolved ``[model]`` table (the kiln
    layout's config.json); ``recipe_file`` is copied beside the weights. Loading a checkpoint
    into a model is the caller's job (``kiln.recipes.saved_model``).

    A non-empty ``out_dir`` is refused unless ``force``; then only the files the export writes
    are replaced in it, nothing else there is touched. The files are written into a fresh
    temporary folder beside ``out_dir`` first (moved into place at the end, removed on error):
    export never deletes anything it did not create."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise RecipeError(f"{out_dir}: exists and is not a folder; give a folder to export "
                              "into")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise RecipeError(
            f"{out_dir}: folder exists and is not empty; export into a new or empty folder, or "
            f"pass --force to overwrite only {', '.join(EXPORT_FILES)} in it"
        )
    reason = llama_incompatibility(model)
    if fmt == "hf" and reason:
        raise CheckpointError(f"--format hf: this model has no Llama layout: {reason}; use "
                              "--format kiln")
    use_hf = fmt == "hf" or (fmt == "auto" and not reason)
    if use_hf:
        tensors, config = to_llama(model, tokenizer)
    else:
        tensors, config = _kiln_layout(model, model_table)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".kiln-export",
                                dir=out_dir.parent))
    try:
        save_safetensors(tensors, tmp / "model.safetensors", {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        shutil.copyfile(recipe_file, tmp / "recipe.toml")
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()  # an empty folder: take its place
        if out_dir.exists():  # --force into a non-empty folder: replace our files only
            for name in EXPORT_FILES:
                os.replace(tmp / name, out_dir / name)
        else:
            tmp.rename(out_dir)
    except OSError as exc:
        raise CheckpointError(f"{out_dir}: cannot write the export ({exc})") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)  # the temporary folder this call created, and only it
    return {"layout": "hf" if use_hf else "kiln", "tensors": len(tensors),
            "why_not_hf": reason, "files": list(EXPORT_FILES)}


def _kiln_layout(model: torch.nn.Module, model_table: dict) -> tuple[dict, dict]:
    tensors, seen = {}, {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:  # tied weights: safetensors stores a tensor once
            continue
        seen[key] = name
        tensors[name] = t.detach().contiguous()
    config = {"format": "kiln", "model": model_table,
              "vocab_size": getattr(model, "vocab_size", None),
              "num_params": int(model.num_params()) if hasattr(model, "num_params") else None}
    return tensors, config


def llama_incompatibility(model: torch.nn.Module) -> str:
    """Why the model has no Llama layout ("" if it has one)."""
    from kiln.components.attention.causal import CausalAttention
    from kiln.components.ffn.swiglu import SwiGLU
    from kiln.components.models.transformer import Transformer
    from kiln.components.norms.rmsnorm import RMSNorm
    from kiln.components.positions.rope import RoPE

    if type(model) is not Transformer:
        return f"model is {type(model).__name__}, not the dense transformer"
    if model.logit_softcap:
        return "logit soft-capping"
    for i, block in enumerate(model.blocks()):
        attn, ffn = block.attention, block.feed_forward
        if type(attn) is not CausalAttention:
            return f"layer {i} attention is {type(attn).__name__}"
        if attn.q_norm is not None:
            return "QK-norm"
        if type(attn.position) is not RoPE:
            return f"position encoding {type(attn.position).__name__}"
        if type(ffn) is not SwiGLU:
            return f"layer {i} feed-forward is {type(ffn).__name__}"
        if block.attention_scale is not None:
            return "LayerScale"
        for norm in (block.attention_norm, block.ffn_norm):
            if type(norm) is not RMSNorm or norm.weight is None:
                return "norms other than RMSNorm with a weight"
    if type(model.norm) is not RMSNorm or model.norm.weight is None:
        return "final norm is not RMSNorm with a weight"
    return ""


def rope_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from adjacent-pair to half-split RoPE order, per head."""
    rows = w.shape[0]
    d = rows // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def to_llama(model, tokenizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    from kiln.components.attention.causal import split_fused_rows

    blocks = model.blocks()
    attn0, ffn0 = blocks[0].attention, blocks[0].feed_forward
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.tok_embeddings.weight}
    bias = None
    for i, block in enumerate(blocks):
        a, f, p = block.attention, block.feed_forward, f"model.layers.{i}."
        if hasattr(a, "wqkv"):
            group, hd = a.n_heads // a.n_kv_heads, a.head_dim
            q, k, v = split_fused_rows(a.wqkv.weight, group, hd)  # kv-grouped rows
            qb, kb, vb = (split_fused_rows(a.wqkv.bias, group, hd) if a.wqkv.bias is not None
                          else (None,) * 3)
            ob = a.wo.bias
        else:
            q, k, v = a.wq.weight, a.wk.weight, a.wv.weight
            qb, kb, vb, ob = (m.bias for m in (a.wq, a.wk, a.wv, a.wo))
        out[p + "self_attn.q_proj.weight"] = rope_permute(q, a.n_heads)
        out[p + "self_attn.k_proj.weight"] = rope_permute(k, a.n_kv_heads)
        out[p + "self_attn.v_proj.weight"] = v
        out[p + "self_attn.o_proj.weight"] = a.wo.weight
        bias = qb is not None
        if bias:
            out[p + "self_attn.q_proj.bias"] = rope_permute(qb, a.n_heads)
            out[p + "self_attn.k_proj.bias"] = rope_permute(kb, a.n_kv_heads)
            out[p + "self_attn.v_proj.bias"] = vb
            out[p + "self_attn.o_proj.bias"] = ob
        out[p + "input_layernorm.weight"] = block.attention_norm.weight
        out[p + "post_attention_layernorm.weight"] = block.ffn_norm.weight
        out[p + "mlp.gate_proj.weight"] = f.w1.weight
        out[p + "mlp.up_proj.weight"] = f.w3.weight
        out[p + "mlp.down_proj.weight"] = f.w2.weight
    out["model.norm.weight"] = model.norm.weight
    if not model.tied:
        out["lm_head.weight"] = model.output.weight
    tensors = {k: v.detach().contiguous().clone() for k, v in out.items()}
    dtype = str(model.tok_embeddings.weight.dtype).removeprefix("torch.")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": model.vocab_size,
        "hidden_size": model.dim,
        "intermediate_size": ffn0.hidden_dim,
        "num_hidden_layers": len(blocks),
        "num_attention_heads": attn0.n_heads,
        "num_key_value_heads": attn0.n_kv_heads,
        "head_dim": attn0.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": model.max_seq_len,
        "rms_norm_eps": model.norm.eps,
        "rope_theta": attn0.position.theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": attn0.position.theta},
        "attention_bias": bool(bias),
        "mlp_bias": False,
        "tie_word_embeddings": bool(model.tied),
        "bos_token_id": getattr(tokenizer, "bos_id", None),
        "eos_token_id": getattr(tokenizer, "eos_id", None),
        "torch_dtype": dtype,
        "kiln": {"exported_from": "kiln transformer", "rope": "permuted to half-split"},
    }
    return tensors, config

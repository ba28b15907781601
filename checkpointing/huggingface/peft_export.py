"""A model's adapters (LoRA, DoRA) as a ``peft`` adapter folder: ``adapter_config.json`` and
``adapter_model.safetensors``, loadable with ``PeftModel.from_pretrained(base, folder)`` on the
Hugging Face export of the base model.

Each adapted kiln layer maps to its Hugging Face module through the export layout
(``layout.parts``): ``layers.N.attention.wq`` is ``model.layers.N.self_attn.q_proj``, saved as
``base_model.model.<module>.lora_A.weight`` (rank, in) and ``.lora_B.weight`` (out, rank), the
names peft writes (DoRA adds ``.lora_magnitude_vector`` (out,)). ``B``'s rows and the
magnitude's follow the base weight's rows, so those of ``wq`` / ``wk`` get the same RoPE
permutation (``to_hf``); ``A`` acts on the layer's input, whose order both layouts
share. ``target_modules`` is a regular expression naming exactly the adapted modules, so peft
adds no adapter where kiln had none.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.checkpointing.huggingface import config as hf_config
from kiln.checkpointing.huggingface import layout as hf_layout
from kiln.checkpointing.huggingface.parts import to_hf
from kiln.checkpointing.storage import save_safetensors
from kiln.components.adapter_contract import adapter_layers
from kiln.components.errors import CheckpointError
from kiln.parallelisms.blocks import clean_name

CONFIG = "adapter_config.json"
# Families whose MoE weights transformers 5 converts on load: peft (0.21) then renames every
# target named gate / gate_proj / up_proj / down_proj to the routed experts' fused parameters,
# also those of a shared expert, a dense layer or the router.
PEFT_RENAMES_MLP = {"deepseek_v3", "qwen3_next"}
MLP_NAMES = ("gate", "gate_proj", "up_proj", "down_proj")
WEIGHTS = "adapter_model.safetensors"


def peft_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[str], int]:
    """(peft's tensors by name, the Hugging Face modules adapted, how many of those store their
    weight transposed: GPT-2's ``Conv1D``). Each adapter names its own tensors
    (``AdapterLayer.peft_tensors``); those whose rows follow the base weight's output rows get
    the layout's permutation. A ``Conv1D``'s adapter tensors are those of an ``nn.Linear``
    (peft's ``lora_A`` (rank, in), ``lora_B`` (out, rank)): only the config's
    ``fan_in_fan_out`` tells peft to transpose their product when it merges."""
    found = adapter_layers(model)
    if not found:
        raise CheckpointError("--format peft: the model has no adapters ([adapter] table); "
                              "export its weights with --format hf")
    reason = hf_layout.hf_incompatibility(model)
    if reason:
        raise CheckpointError(f"--format peft: the model has no Hugging Face layout ({reason})")
    parts = hf_layout.parts(model)
    family = hf_config.family_of(model)
    extent: dict[str, int] = {}  # rows of each Hugging Face tensor, over every part of it
    for pieces in parts.values():
        for p in pieces:
            extent[p.hf_name] = max(extent.get(p.hf_name, 0), p.start + p.rows)
    out: dict[str, torch.Tensor] = {}
    modules, transposed = [], 0
    for name, (_, _, layer) in found.items():
        got = parts.get(f"{clean_name(name)}.weight", [])
        if len(got) != 1:
            raise CheckpointError(
                f"--format peft: {clean_name(name)} is made of {len(got)} Hugging Face tensors "
                "or pieces (a fused wqkv; Qwen3-Next's query rows, interleaved with its gate's); "
                "peft adapts one module at a time: export merged weights instead")
        part = got[0]
        if part.rows != extent[part.hf_name]:  # one piece of a tensor that holds others
            raise CheckpointError(
                f"--format peft: {clean_name(name)} is {part.rows} of the {extent[part.hf_name]} "
                f"rows of {part.hf_name} (GPT-2's c_attn holds q, k and v, Qwen3-Next's q_proj "
                "the output gate too, its in_proj_qkvz q, k, v and z); peft adapts one whole "
                "module at a time: export merged weights instead")
        module = part.hf_name.removesuffix(".weight")
        if clean_name(name).endswith("feed_forward.router"):
            raise CheckpointError(
                f"--format peft: {clean_name(name)} is {module}, transformers' router module "
                "(a TopKRouter, not an nn.Linear), which peft cannot adapt; export merged "
                "weights instead")
        if family in PEFT_RENAMES_MLP and module.rsplit(".", 1)[-1] in MLP_NAMES:
            raise CheckpointError(
                f"--format peft: {clean_name(name)} is {module}; peft renames every "
                f"{'/'.join(MLP_NAMES)} target of a {family} model to its routed experts' fused "
                "weights (transformers 5's MoE conversion), so the adapter would load onto other "
                "weights; export merged weights instead, or adapt attention and the output layer")
        for suffix, (tensor, output_rows) in layer.peft_tensors().items():
            t = tensor.detach().float().cpu()
            out[f"base_model.model.{module}.{suffix}"] = (
                to_hf(t, part.heads, part.rope_dim) if output_rows else t).contiguous()
        modules.append(module)
        transposed += part.transposed
    return out, modules, transposed


def export_peft(model: nn.Module, out_dir: str | Path, *, base: str, fields: dict[str, Any],
                force: bool = False) -> dict[str, Any]:
    """Write the adapter folder: ``fields`` are the adapter's own (``peft_type``, ``r``,
    ``lora_alpha``, ... from ``AdapterContract.peft_config``); ``base`` names the base model
    (``checkpoint.init_from``). The base's weights are not read: only the adapters' tensors and
    the layout's names."""
    out_dir = Path(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not force:
        raise CheckpointError(f"{out_dir}: folder exists and is not empty; export into a new "
                              "or empty folder, or pass --force")
    if not fields:
        raise CheckpointError("--format peft: this adapter type has no peft form; export the "
                              "merged weights instead (--format hf)")
    tensors, modules, transposed = peft_tensors(model)
    config = {
        # peft sets the flag per module from its type (and warns where the config says
        # otherwise): true where the adapted modules are GPT-2's Conv1D layers
        "task_type": "CAUSAL_LM", "bias": "none", "fan_in_fan_out": transposed > 0,
        "target_modules": "(" + "|".join(re.escape(m) for m in modules) + ")",
        "base_model_name_or_path": base, "inference_mode": True, "modules_to_save": None,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False,
        "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, **fields,
    }
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.{secrets.token_hex(6)}.kiln-export"
    tmp.mkdir()
    try:
        save_safetensors(tensors, tmp / WEIGHTS, {"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        if out_dir.is_dir() and not any(out_dir.iterdir()):
            out_dir.rmdir()
        if out_dir.exists():  # --force: replace the two files
            for path in tmp.iterdir():
                os.replace(path, out_dir / path.name)
        else:
            tmp.rename(out_dir)
    except OSError as exc:
        raise CheckpointError(f"{out_dir}: cannot write the adapter ({exc})") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return {"layout": "peft", "family": config["peft_type"].lower(), "tensors": len(tensors),
            "why_not_hf": "", "files": [CONFIG, WEIGHTS]}

"""A kiln model's gradients under Hugging Face's names and layout, for parity with TRL."""

from __future__ import annotations

import copy

import torch
from safetensors.torch import load_file

from kiln.checkpointing.huggingface.export import export


def hf_grads(kiln_model, folder) -> dict[str, torch.Tensor]:
    """kiln's gradients under Hugging Face's names and layout (exported as if weights)."""
    grads = copy.deepcopy(kiln_model)
    with torch.no_grad():
        for (_, g), (_, p) in zip(grads.named_parameters(), kiln_model.named_parameters(),
                                  strict=True):
            g.copy_(p.grad)
    export(grads, None, folder, model_table={}, recipe_file=None, force=True)
    out = {}
    for f in folder.glob("*.safetensors"):
        out.update(load_file(f))
    return out

"""A checkpoint's model, rebuilt from the recipe it holds: for ``kiln eval`` and ``kiln export``
(the checkpointing package reads and writes tensors; building models from recipes happens here,
on the top floor)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from kiln.checkpointing import export as export_lib
from kiln.checkpointing import layout, storage
from kiln.components.models.block import padded_vocab
from kiln.recipes.recipe import load_recipe, to_dict


def load_model(checkpoint: Path):
    """(recipe, tokenizer, model with the checkpoint's weights on the CPU)."""
    layout.verify(checkpoint, hashes=True)
    recipe = load_recipe(checkpoint)
    tokenizer = recipe.tokenizer.build()
    with torch.device("meta"):
        model = recipe.model.build(vocab_size=padded_vocab(recipe.model, tokenizer.vocab_size),
                                   seq_len=recipe.training.seq_len)
    model = model.to_empty(device="cpu")
    sd = get_model_state_dict(model)
    tensors, _ = storage.split_tree({"model": sd})
    storage.load_tensors(tensors, checkpoint, no_dist=True,
                         hint=" -- cannot load the model's weights from the recipe it holds")
    model.load_state_dict(tensors["model"], strict=False)
    for module in model.modules():  # non-persistent buffers (RoPE tables) are derived
        reset = getattr(module, "reset_buffers", None)
        if reset is not None:
            reset()
    return recipe, tokenizer, model


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, fmt: str = "auto", *,
                      force: bool = False) -> dict[str, Any]:
    """``kiln export``: load the checkpoint's model and write it (``checkpointing.export``;
    a non-empty ``out_dir`` needs ``force``)."""
    checkpoint = Path(checkpoint)
    recipe, tokenizer, model = load_model(checkpoint)
    return export_lib.export(model, tokenizer, out_dir, model_table=to_dict(recipe)["model"],
                             recipe_file=checkpoint / "recipe.toml", fmt=fmt, force=force)

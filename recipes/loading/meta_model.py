"""A recipe's model on the meta device: its shape, parameter count and FLOPs without memory
(``kiln validate``, ``kiln fit`` reading a ladder's run folders)."""

from __future__ import annotations

import torch

from kiln.components.models.block import padded_vocab


def build_meta_model(recipe, tokenizer=None):
    tokenizer = tokenizer or recipe.tokenizer.build()
    with torch.device("meta"):
        return recipe.model.build(vocab_size=padded_vocab(recipe.model, tokenizer.vocab_size),
                                  seq_len=recipe.training.seq_len)

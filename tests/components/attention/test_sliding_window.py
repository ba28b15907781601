"""Sliding-window attention: the mask (a query sees itself and the window - 1 keys before it,
as transformers' Mistral), the per-layer pattern, FLOPs, and one clear line for a pattern or a
window that cannot be. Parity with transformers is in tests/checkpointing/huggingface (Mistral,
Qwen2 / Qwen3 layer_types: logits, gradients, export); the cache and the document mask in
test_kv_cache.py and test_document_mask.py (the combination test's moe family slides)."""

from __future__ import annotations

import pytest
import torch

from kiln.components.attention.context import visibility
from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS

TINY = ["--model.dim=32", "--model.n_layers=3", "--model.attention.n_heads=4",
        "--model.ffn.hidden_dim=48", "--training.seq_len=16"]


def test_a_query_sees_the_window_of_keys_ending_at_itself():
    seen = visibility(6, torch.arange(6), None, window=3)[0, 0]
    assert seen.int().tolist() == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                   [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


def test_layer_types_set_each_layers_window_and_its_flops():
    recipe = load_recipe(CONFIGS / "debug.toml", [
        *TINY, "--model.attention.window=4", '--model.layer_types=["sliding","full","sliding"]'])
    model = recipe.model.build(vocab_size=258, seq_len=16)
    assert [b.attention.window for b in model.blocks()] == [4, 0, 4]
    full = load_recipe(CONFIGS / "debug.toml", TINY).model.build(vocab_size=258, seq_len=16)
    head = 4 * 8  # heads x head width
    assert full.flops_per_token(16) - model.flops_per_token(16) == 2 * 12 * head * (16 - 4)


@pytest.mark.parametrize("overrides, message", [
    (['--model.layer_types=["sliding","full"]', "--model.attention.window=4"],
     "model.layer_types has 2 entries for n_layers = 3"),
    (['--model.layer_types=["sliding","full","full"]'], "model.attention.window = 0"),
    (["--model.attention.window=32"], r"window = 32 is longer than the sequence "
                                      r"\(training.seq_len = 16\)"),
    (["--model.attention.window=32", "--model.max_seq_len=24"], r"model.max_seq_len = 24"),
    (['--model.layer_types=["local","full","full"]', "--model.attention.window=4"],
     "layer_types"),
])
def test_patterns_and_windows_that_cannot_be(overrides, message):
    with pytest.raises(RecipeError, match=message):
        load_recipe(CONFIGS / "debug.toml", [*TINY, *overrides])

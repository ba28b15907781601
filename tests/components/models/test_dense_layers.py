"""``model.dense_layers`` + ``[model.dense_ffn]``: DeepSeek-V3's dense layers before the MoE ones
(first_k_dense_replace). The first N blocks take the dense table, the rest ``model.ffn``; the
model trains, counts its active parameters by layer, and a half-given pair is one clear line."""

from __future__ import annotations

import pytest
import torch

from kiln.components.errors import RecipeError
from kiln.components.ffn.moe import MoE
from kiln.components.ffn.swiglu import SwiGLU
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS

MIXED = ["--model.dim=32", "--model.n_layers=3", "--model.attention.n_heads=4",
         "--model.ffn.type=moe", "--model.ffn.n_experts=4", "--model.ffn.hidden_dim=16",
         "--model.dense_layers=1", "--model.dense_ffn.hidden_dim=64", "--training.seq_len=16"]


def test_the_first_layers_are_dense_and_the_rest_routed():
    recipe = load_recipe(CONFIGS / "debug.toml", MIXED)
    assert recipe.model.dense_ffn.type == "swiglu"  # the table's implied type
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=258, seq_len=16)
    kinds = [type(b.feed_forward) for b in model.blocks()]
    assert kinds == [SwiGLU, MoE, MoE] and model.blocks()[0].feed_forward.hidden_dim == 64
    model(torch.randint(0, 258, (2, 16))).logsumexp(-1).mean().backward()
    assert model.blocks()[0].feed_forward.w1.weight.grad.abs().sum() > 0
    dense = sum(p.numel() for p in model.blocks()[0].feed_forward.parameters())
    moe = model.blocks()[1].feed_forward
    assert model.num_params(active_only=True) == model.num_params() - 2 * (
        sum(p.numel() for p in moe.parameters()) - moe.active_params())
    assert dense == 3 * 32 * 64


def test_a_half_given_pair_is_one_clear_line():
    with pytest.raises(RecipeError, match="give both or neither"):
        load_recipe(CONFIGS / "debug.toml", MIXED[:6] + ["--model.dense_layers=1"])
    with pytest.raises(RecipeError, match="dense_layers = 4 is more than n_layers = 3"):
        load_recipe(CONFIGS / "debug.toml", [*MIXED, "--model.dense_layers=4"])

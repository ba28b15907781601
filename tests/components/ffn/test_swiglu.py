"""SwiGLU: the Llama hidden-width rule and the forward formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.components.base import default_config
from kiln.components.ffn.swiglu import SwiGLUConfig, hidden_dim


@pytest.mark.parametrize(
    ("dim", "values", "want"),
    [
        (256, {}, 768),  # int(8*256/3) = 682 -> 768 (torchtitan llama3 debug)
        (4096, {"ffn_dim_multiplier": 1.3, "multiple_of": 1024}, 14336),  # Llama 3 8B
        (8192, {"ffn_dim_multiplier": 1.3, "multiple_of": 4096}, 28672),  # Llama 3 70B
        (4096, {}, 11008),  # Llama 2 7B
        (256, {"hidden_dim": 100}, 100),  # explicit width wins
    ],
)
def test_hidden_dim_rule(dim, values, want):
    assert hidden_dim(SwiGLUConfig(type="swiglu", **values), dim) == want


def test_a_multiplier_beyond_any_model_is_refused_with_the_recipe():
    """ffn_dim_multiplier = 1e30 overflowed torch.empty's size: a bare TypeError at build."""
    from kiln.components.errors import RecipeError
    from kiln.recipes.config.files import load_recipe
    from tests.conftest import CONFIGS

    with pytest.raises(RecipeError, match=r"model.ffn.ffn_dim_multiplier = 1e\+30: Input should "
                       "be less than or equal to 64"):
        load_recipe(CONFIGS / "debug.toml", ["--model.ffn.ffn_dim_multiplier=1e30"])


def test_forward_formula_and_names():
    torch.manual_seed(0)
    ffn = default_config("ffn", "swiglu", hidden_dim=24).build(dim=16, layer_idx=0, n_layers=2)
    assert {n for n, _ in ffn.named_parameters()} == {"w1.weight", "w2.weight", "w3.weight"}
    x = torch.randn(2, 5, 16)
    want = F.linear(F.silu(F.linear(x, ffn.w1.weight)) * F.linear(x, ffn.w3.weight), ffn.w2.weight)
    torch.testing.assert_close(ffn(x), want)


def test_init_weights_uses_out_std_for_w2():
    torch.manual_seed(0)
    ffn = default_config("ffn", "swiglu", hidden_dim=512).build(dim=512, layer_idx=0, n_layers=1)
    ffn.init_weights(std=0.02, out_std=0.002)
    assert abs(ffn.w1.weight.std().item() - 0.02) < 1e-3
    assert abs(ffn.w3.weight.std().item() - 0.02) < 1e-3
    assert abs(ffn.w2.weight.std().item() - 0.002) < 1e-4

"""The pre-norm block: residual structure, LayerScale, and the init protocol's fallback."""

from __future__ import annotations

import torch
from torch import nn

from kiln.components.models.block import Block, init_component


def _block(layerscale_init: float = 0.0) -> Block:
    torch.manual_seed(0)
    return Block(
        attention=nn.Linear(8, 8), feed_forward=nn.Linear(8, 8), attention_norm=nn.LayerNorm(8),
        ffn_norm=nn.LayerNorm(8), dim=8, layerscale_init=layerscale_init,
    )


def test_pre_norm_residual_formula():
    b = _block()
    x = torch.randn(2, 3, 8)
    h = x + b.attention(b.attention_norm(x))
    torch.testing.assert_close(b(x), h + b.feed_forward(b.ffn_norm(h)))
    assert b.attention_scale is None


def test_layerscale_scales_each_branch():
    b = _block(layerscale_init=1e-3)
    assert b.attention_scale.shape == (8,) and torch.all(b.attention_scale == 1e-3)
    x = torch.randn(2, 3, 8)
    h = x + 1e-3 * b.attention(b.attention_norm(x))
    torch.testing.assert_close(b(x), h + 1e-3 * b.feed_forward(b.ffn_norm(h)))
    with torch.no_grad():
        b.ffn_scale.fill_(5.0)
    b.init_weights(std=0.02, out_std=0.01)
    assert torch.all(b.ffn_scale == 1e-3)


def test_init_component_falls_back_to_reset_parameters():
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        lin.weight.zero_()
    init_component(nn.Sequential(lin), std=0.02, out_std=0.01)
    assert lin.weight.abs().sum() > 0

"""LayerNorm equals torch's nn.LayerNorm in each form (scale and shift, scale only, neither: OLMo
1's non-parametric norm), also for bf16 activations with fp32 parameters."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.components.norms.layernorm import LayerNorm, LayerNormConfig


@pytest.mark.parametrize("affine, bias", [(True, True), (True, False), (False, False)])
def test_equals_torch_layernorm_values_and_gradients(affine, bias):
    ours = LayerNorm(LayerNormConfig(type="layernorm", elementwise_affine=affine, bias=bias),
                     dim=8)
    theirs = nn.LayerNorm(8, eps=1e-5, elementwise_affine=affine, bias=bias)
    with torch.no_grad():
        for p, q in zip(ours.parameters(), theirs.parameters(), strict=True):
            p.copy_(torch.randn_like(p))
            q.copy_(p)
    x = torch.randn(2, 3, 8, requires_grad=True)
    a, b = ours(x), theirs(x)
    torch.testing.assert_close(a, b)
    params = list(ours.parameters())
    ga = torch.autograd.grad(a.sin().sum(), [x, *params])
    gb = torch.autograd.grad(b.sin().sum(), [x, *theirs.parameters()])
    for u, v in zip(ga, gb, strict=True):
        torch.testing.assert_close(u, v)
    assert len(params) == int(affine) + int(bias)


def test_bf16_activations_normalise_in_fp32_and_round_once():
    ours = LayerNorm(LayerNormConfig(type="layernorm"), dim=8)
    with torch.no_grad():
        ours.weight.normal_()
        ours.bias.normal_()
    x = torch.randn(4, 8).bfloat16()
    want = nn.functional.layer_norm(x.float(), (8,), ours.weight, ours.bias, 1e-5).bfloat16()
    got = ours(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)

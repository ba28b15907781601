"""RMSNorm: the formula, the optional weight, and building from the registry."""

from __future__ import annotations

import torch

from kiln.components.base import default_config


def test_matches_manual_formula():
    torch.manual_seed(0)
    norm = default_config("norm", "rmsnorm", eps=1e-5).build(dim=8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 8)
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    torch.testing.assert_close(norm(x), want)


def test_without_affine_has_no_parameters():
    norm = default_config("norm", "rmsnorm", elementwise_affine=False).build(dim=8)
    assert list(norm.parameters()) == []
    x = torch.randn(4, 8)
    torch.testing.assert_close(norm(x).pow(2).mean(-1), torch.ones(4), atol=1e-4, rtol=0)


def test_reset_parameters_sets_ones():
    norm = default_config("norm", "rmsnorm").build(dim=4)
    with torch.no_grad():
        norm.weight.fill_(3.0)
    norm.reset_parameters()
    assert torch.equal(norm.weight, torch.ones(4))

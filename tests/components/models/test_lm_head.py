"""Chunked cross-entropy equals the unchunked head + F.cross_entropy: loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.components.models.lm_head import (
    IGNORE_INDEX,
    LossHead,
    chunk_loss_sum,
    chunked_cross_entropy,
    logits,
)


def _case(n=37, d=16, v=50, seed=0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, dtype=torch.float64).float().requires_grad_()
    head = nn.Linear(d, v, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, d, generator=g))
    labels = torch.randint(0, v, (n,), generator=g)
    if ignore:
        labels[::7] = IGNORE_INDEX
    return hidden, head, labels


def _reference(hidden, head, labels, cap):
    return F.cross_entropy(logits(hidden, head, cap).float(), labels)


@pytest.mark.parametrize("cap", [0.0, 3.0])
@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
def test_loss_and_grads_equal_unchunked(cap, chunk):
    hidden, head, labels = _case()
    ref = _reference(hidden, head, labels, cap)
    gh_ref, gw_ref = torch.autograd.grad(ref, (hidden, head.weight))
    loss = chunked_cross_entropy(hidden, head.weight, labels, cap=cap, chunk_tokens=chunk)
    gh, gw = torch.autograd.grad(loss, (hidden, head.weight))
    assert abs(loss.item() - ref.item()) < 1e-6
    torch.testing.assert_close(gh, gh_ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-7)


def test_upstream_gradient_scales_and_no_grad_path_matches():
    hidden, head, labels = _case(ignore=False)
    ref = _reference(hidden, head, labels, 0.0)
    (0.25 * ref).backward()
    gh_ref, gw_ref = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    (0.25 * chunked_cross_entropy(hidden, head.weight, labels, chunk_tokens=5)).backward()
    torch.testing.assert_close(hidden.grad, gh_ref)
    torch.testing.assert_close(head.weight.grad, gw_ref)
    with torch.no_grad():
        plain = chunked_cross_entropy(hidden, head.weight, labels, chunk_tokens=5)
    assert not plain.requires_grad and abs(plain.item() - ref.item()) < 1e-6


def test_frozen_weight_gets_no_gradient_and_bf16_autocast_matches():
    hidden, head, labels = _case()
    head.weight.requires_grad_(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _reference(hidden, head, labels, 2.0)
        loss = chunked_cross_entropy(hidden, head.weight, labels, cap=2.0, chunk_tokens=8)
    assert abs(loss.item() - ref.item()) < 1e-6
    (g_ref,) = torch.autograd.grad(ref, hidden)
    (g,) = torch.autograd.grad(loss, hidden)
    torch.testing.assert_close(g, g_ref, rtol=2e-2, atol=1e-4)  # bf16 matmul in backward


def test_batched_shapes_and_a_custom_chunk_function():
    hidden, head, labels = _case(n=24)
    calls = []

    def spy(h, w, y, cap):
        calls.append(h.shape[0])
        return chunk_loss_sum(h, w, y, cap)

    loss = LossHead(labels.view(4, 6), 10, spy)(hidden.view(4, 6, -1), head.weight, 0.0)
    assert calls == [10, 10, 4]
    assert abs(loss.item() - _reference(hidden, head, labels, 0.0).item()) < 1e-6
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_cross_entropy(hidden, head.weight, labels, chunk_tokens=0)

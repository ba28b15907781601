"""Sliding-window attention over bands of keys equals the masked full attention (outputs and
gradients), with and without documents, sinks, grouped heads, a row that is not a multiple of
the window and values wider than keys; and it is used only where it pays."""

from __future__ import annotations

import pytest
import torch

from kiln.components.attention import banded
from kiln.components.attention.context import build_context, sdpa, visibility


def _inputs(b, h, hk, t, d, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    # kiln's layout: (B, T, H, D) memory handed over as (B, H, T, D) views
    q, k, v = (torch.randn(b, t, n, w, generator=g).transpose(1, 2).requires_grad_()
               for n, w in ((h, d), (hk, d), (hk, dv or d)))
    return q, k, v


def _run(q, k, v, window, docs, sinks, banding, monkeypatch):
    monkeypatch.setattr(banded, "MIN_BLOCKS", banded.MIN_BLOCKS if banding else 10**9)
    context = None if docs is None else build_context(q.shape[2], doc_ids=docs)
    out = sdpa(q, k, v, context, window=window, sinks=sinks)
    inputs = [q, k, v] + ([sinks] if sinks is not None else [])
    grads = torch.autograd.grad(out, inputs, torch.ones_like(out) + out.detach())
    return out, grads


@pytest.mark.parametrize("b, h, hk, t, d, dv, window, docs, sinks", [
    (2, 4, 2, 60, 16, None, 12, False, False),  # GQA, 5 windows
    (2, 4, 4, 50, 8, None, 8, True, False),  # documents; 50 = 6 x 8 + 2: the last band padded
    (1, 4, 2, 40, 8, None, 6, False, True),  # sinks (gpt-oss), padded
    (2, 2, 1, 48, 8, 12, 8, True, False),  # values wider than keys (MLA), documents
])
def test_banded_equals_the_masked_full_attention(b, h, hk, t, d, dv, window, docs, sinks,
                                                 monkeypatch):
    assert banded.worth_it(t, t, window)
    q, k, v = _inputs(b, h, hk, t, d, dv)
    doc_ids = torch.cumsum(torch.rand(b, t, generator=torch.Generator().manual_seed(1)) < 0.1,
                           1) if docs else None
    sink = torch.randn(h, requires_grad=True) if sinks else None
    ours, our_grads = _run(q, k, v, window, doc_ids, sink, True, monkeypatch)
    ref, ref_grads = _run(q, k, v, window, doc_ids, sink, False, monkeypatch)
    assert ours.shape == ref.shape == (b, h, t, dv or d)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(our_grads, ref_grads, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)
    # the caller's (B, T, H * Dv) view of the heads needs the (B, T, H, Dv) memory layout
    assert ours.transpose(1, 2).reshape(b, t, -1).shape == (b, t, h * (dv or d))


def test_a_band_holds_what_the_full_mask_shows():
    """Query j of block i, band key m = the key at (i - 1) W + m: visible exactly where the full
    (T, T) visibility says so (documents included); padding queries see their own key only."""
    t, w = 23, 4
    docs = torch.tensor([[0] * 9 + [1] * 10 + [2] * 4])
    band = banded.band_mask(t, w, docs, "cpu")[0]  # (blocks, W, 2W)
    full = visibility(t, torch.arange(t), docs, window=w)[0, 0]
    blocks = band.shape[0]
    assert blocks == 6
    for i in range(blocks):
        for j in range(w):
            for m in range(2 * w):
                query, key = i * w + j, (i - 1) * w + m
                real = 0 <= key < t and bool(full[min(query, t - 1), min(key, t - 1)])
                expected = key == query if query >= t else real
                assert bool(band[i, j, m]) == expected, (i, j, m)


def test_only_whole_rows_with_enough_windows_run_banded():
    assert banded.worth_it(250, 250, 50) and banded.worth_it(201, 201, 50)
    assert not banded.worth_it(200, 200, 50)  # 4 windows: the full kernel was faster
    assert not banded.worth_it(100, 400, 50)  # context parallel: this rank's queries only
    assert not banded.worth_it(400, 400, 0)  # no window


def test_the_band_masks_are_built_once_per_forward_or_shape():
    """With documents once per forward and window (every layer shares it); without, once per
    shape for every layer and step. Either is band_mask's, additive, a row per block."""
    docs = torch.zeros(2, 60, dtype=torch.long)
    docs[1, 30:] = 1
    context = build_context(60, doc_ids=docs)
    first = context.band_for(10, 2)
    assert context.band_for(10, 2) is first and first.shape == (2 * 6, 1, 10, 20)
    assert context.band_for(12, 2) is not first
    expected = banded.band_mask(60, 10, docs, "cpu").reshape(12, 1, 10, 20)
    assert torch.equal(first == 0, expected)
    plain = banded.shared_mask(60, 10, 2, torch.device("cpu"))
    assert banded.shared_mask(60, 10, 2, torch.device("cpu")) is plain
    assert torch.equal(plain == 0, banded.band_mask(60, 10, None, "cpu").expand(2, -1, -1, -1)
                       .reshape(12, 1, 10, 20))

"""Sliding-window attention in training: kiln's banded layer (``components/attention/banded.py``:
blocks of W queries over the 2W keys they can reach) against the same layer given the whole
(T, T) window mask (what kiln ran before, and what SDPA computes from a mask: every score, the
far ones hidden). Both sides are kiln's ``sdpa`` on the same inputs, the peer with banding off.
One layer's attention forward and backward (q, k, v needing gradients), a Mistral-like head
shape (8 heads of 64, 2 kv heads), a window of 128, batch 1, fp32. Median milliseconds."""

from __future__ import annotations

from bench_rows.common import median_seconds, set_threads

HEADS, KV_HEADS, HEAD_DIM, WINDOW = 8, 2, 64, 128


def _time(p: dict, banding: bool) -> dict:
    import torch

    from kiln.components.attention import banded
    from kiln.components.attention.context import sdpa

    set_threads(p["threads"])
    if not banding:
        banded.MIN_BLOCKS = 10**9
    t = p["length"]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, t, n, HEAD_DIM, generator=g).transpose(1, 2).requires_grad_()
               for n in (HEADS, KV_HEADS, KV_HEADS))

    def step():
        sdpa(q, k, v, None, window=WINDOW).sum().backward()

    for _ in range(p["warmup"]):
        step()
    return {"step_ms": median_seconds(step, p["steps"]) * 1e3}


def kiln(p: dict) -> dict:
    return _time(p, banding=True)


def peer(p: dict) -> dict:
    return _time(p, banding=False)

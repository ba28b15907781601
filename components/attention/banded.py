"""Sliding-window attention over bands of keys: the cost of the window, not of the whole row.

A layer with a window of W tokens lets a query see itself and the W - 1 keys before it. Given
the whole (T, T) mask, SDPA's kernels compute every score and hide the far ones (the CPU flash
kernel skips tiles only for ``is_causal``), so a 4,096-token row with a 128-token window cost
what full attention does. Here the queries are cut into blocks of W; block i can see only keys
of blocks i - 1 and i, a band of 2W keys, so the blocks run as one batched call of W queries over
2W keys each (T / W blocks: 2 T W scores against T^2). Keys and values are laid out as
overlapping bands (a copy of twice their size; the backward adds the two bands' gradients
where they overlap); the mask of a band is built from the positions (and
document ids), never from a (T, T) mask. The same ``sdpa`` / ``sink_attention`` kernels run,
so the result is the masked full attention's up to float rounding (the hidden keys' weights were
exactly 0 there).

It applies to self-attention over whole rows (queries = keys, no context parallelism, no shared
prefix, the ``sdpa`` mask kernel; ``flex`` skips masked tiles by itself) where it pays:
``worth_it``, from ``MIN_BLOCKS`` blocks of W per row up.
Rows whose length is not a multiple of W are padded at the end; each padding query sees only
its own (zero) key, so no row of the softmax is empty.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

# From this many windows per row the bands are used. The attention's forward and backward
# alone, CPU flash kernel, 2 threads (docs/benchmarks.md, "Sliding windows"): at 4 blocks the
# two were even (0.89-1.18x: with 2W-key bands the kernel's tiles are few fewer), at 5
# 1.4-1.7x faster, at 8 1.9-2.6x, at 32 9.4x.
MIN_BLOCKS = 5


def worth_it(tq: int, t: int, window: int) -> bool:
    """Whether a layer of ``window`` over ``t`` keys and ``tq`` queries runs banded."""
    return bool(window) and tq == t and -(-t // window) >= MIN_BLOCKS


def band_mask(t: int, window: int, doc_ids: torch.Tensor | None,
              device: torch.device | str) -> torch.Tensor:
    """(B or 1, blocks, W, 2W) bool: query j of block i sees band key m (the key at
    (i - 1) W + m) when that key exists, is at most W - 1 before it and not after it (and in
    the same document when ``doc_ids`` (B, T) is given); a padding query sees its own key."""
    blocks = -(-t // window)
    q_pos = torch.arange(blocks * window, device=device).view(blocks, window, 1)
    k_pos = (torch.arange(-window, (blocks + 1) * window, device=device)
             .unfold(0, 2 * window, window)[:blocks].unsqueeze(1))  # (blocks, 1, 2W)
    seen = (k_pos >= 0) & (k_pos <= q_pos) & (q_pos - k_pos < window) & (q_pos < t)
    if doc_ids is None:
        seen = seen[None]
    else:
        last = t - 1
        docs_q = doc_ids[:, q_pos.clamp(max=last)]  # (B, blocks, W, 1)
        docs_k = doc_ids[:, k_pos.clamp(0, last)]  # (B, blocks, 1, 2W)
        seen = seen & (docs_q == docs_k)
    return seen | ((q_pos >= t) & (k_pos == q_pos))  # padding queries: their own key


def additive_mask(t: int, window: int, doc_ids: torch.Tensor | None, batch: int,
                  device: torch.device | str) -> torch.Tensor:
    """``band_mask`` as the kernels take it: (batch * blocks, 1, W, 2W) fp32, 0 where a key is
    seen, -inf elsewhere. Build it once per forward (``AttentionContext.band_for``) or take
    ``shared_mask`` where no documents make it differ: at a 512-token window over 8,192 tokens it
    took ~50 ms on a 2-core CPU, about what the layer's banded attention costs."""
    seen = band_mask(t, window, doc_ids, device)
    additive = torch.zeros(seen.shape, device=device).masked_fill_(~seen, float("-inf"))
    blocks = seen.shape[1]
    return additive.expand(batch, -1, -1, -1).reshape(batch * blocks, 1, window, 2 * window)


@functools.lru_cache(maxsize=8)
def shared_mask(t: int, window: int, batch: int, device: torch.device) -> torch.Tensor:
    """``additive_mask`` without documents: the same for every layer and step of a shape, so
    kept (a few shapes: training's, evaluation's)."""
    return additive_mask(t, window, None, batch, device)


class _Bands(torch.autograd.Function):
    """(B, H, blocks * W, D) -> (B * blocks, H, 2W, D): block i's band is the keys of blocks
    i - 1 and i (zeros before the row's start), one copy. Written by hand because ``unfold``'s
    backward (a general overlap-add) took longer than the banded kernel saved at 4 blocks; here
    it is one copy and one add of the two halves."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, window: int) -> torch.Tensor:
        b, h, t, d = x.shape
        blocks = t // window
        ctx.shape, ctx.window = x.shape, window
        own = x.unflatten(2, (blocks, window)).transpose(1, 2)  # (B, blocks, H, W, D)
        bands = x.new_empty(b, blocks, h, 2 * window, d)
        bands[:, :, :, window:] = own
        bands[:, 1:, :, :window] = own[:, :-1]
        bands[:, 0, :, :window] = 0
        return bands.view(b * blocks, h, 2 * window, d)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        b, h, t, d = ctx.shape
        w = ctx.window
        grad = grad.view(b, t // w, h, 2 * w, d)
        dx = grad.new_empty(b, t, h, d)  # the layout kiln's q, k, v have: (B, T, H, D)
        own = dx.view(b, t // w, w, h, d).transpose(2, 3)  # (B, blocks, H, W, D)
        own.copy_(grad[:, :, :, w:])
        own[:, :-1] += grad[:, 1:, :, :w]
        return dx.transpose(1, 2), None


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, mask: torch.Tensor,
           run: Any) -> torch.Tensor:
    """Self-attention of q (B, H, T, D) over k, v (B, Hk, T, D[v]) within ``window``, through
    ``run(q, k, v, mask)`` (the caller's kernel on (B * blocks, ., ., .) inputs). ``mask``:
    ``additive_mask``'s for these rows (or ``shared_mask``'s). Returns (B, H, T, Dv), its memory
    laid out as (B, T, H, Dv) like SDPA's."""
    b, h, t, d = q.shape
    blocks = -(-t // window)
    if blocks * window != t:  # zeros at the end: their queries see only their own key
        q, k, v = (F.pad(x, (0, 0, 0, blocks * window - t)) for x in (q, k, v))
    # (B, H, blocks, W, D) -> (B * blocks, H, W, D); a view for kiln's (B, T, H, D) layout
    qb = q.unflatten(2, (blocks, window)).transpose(1, 2).reshape(b * blocks, h, window, d)
    out = run(qb, _Bands.apply(k, window), _Bands.apply(v, window), mask)
    dv = out.shape[-1]
    # (B * blocks, H, W, Dv) -> (B, blocks * W, H, Dv) -> the first T, as (B, H, T, Dv)
    rows = out.view(b, blocks, h, window, dv).transpose(2, 3).reshape(b, blocks * window, h, dv)
    return rows[:, :t].transpose(1, 2)

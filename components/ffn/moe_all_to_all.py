"""Expert-parallel token exchange for ``ffn.moe``: each rank holds ``E / ep`` whole experts and
sends every routed row to the rank that holds its expert (all-to-all), runs its experts on what
it receives, and sends the results back (all-to-all again; the backward is the same pair in
reverse). The parallelism (``kiln.parallelisms.expert_parallel``) shards the expert stacks and
hands the layer its process group; routing stays on each rank's own tokens (replicated router).

Row order: a rank receives, per source rank, its rows for each local expert; they are regrouped
expert-major (source-major within an expert), the order one process sees when the data-parallel
ranks' batches are concatenated, so the experts compute on the same rows in the same order.
"""

from __future__ import annotations

import torch

from kiln.components import distributed
from kiln.components.ffn.moe_dispatch import run_experts


class _AllToAll(torch.autograd.Function):
    """Rows exchanged over ``group``; the gradient goes back along the same splits."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        return distributed.all_to_all_single_(out, x.contiguous(), out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        distributed.all_to_all_single_(back, grad.contiguous(), in_splits, out_splits, ctx.group)
        return back, None, None, None


def run_experts_all_to_all(
    dispatch: str, xs: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor,
    w2: torch.Tensor, group, ep: int,
) -> torch.Tensor:
    """``run_experts`` over ``ep`` ranks: ``xs`` (N*k, D) this rank's rows sorted by global
    expert, ``counts`` (E,) per global expert; ``w1``/``w3``/``w2`` this rank's expert stacks
    (E/ep, ...). Returns the (N*k, D) outputs in ``xs``'s order."""
    n_local = w1.shape[0]
    # How many rows each source sends to each of my experts: (ep, E/ep), one small exchange.
    received = torch.empty_like(counts)
    distributed.all_to_all_single_(received, counts, [n_local] * ep, [n_local] * ep, group)
    received = received.view(ep, n_local)
    send = counts.view(ep, n_local).sum(1).tolist()  # host sync: the splits are sizes
    recv = received.sum(1).tolist()
    rows = _AllToAll.apply(xs, recv, send, group)  # source-major, then local expert
    block = torch.repeat_interleave(torch.arange(ep * n_local, device=counts.device),
                                    received.flatten(), output_size=rows.shape[0])
    source, expert = block // n_local, block % n_local
    order = torch.argsort(expert * ep + source, stable=True)  # expert-major
    ys = run_experts(dispatch, rows[order], w1, w3, w2, received.sum(0))
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return _AllToAll.apply(ys[inverse], send, recv, group)

"""Context parallelism (``parallelism.cp``): every sequence split over ``cp`` ranks.

Load-balanced causal sharding: a row of T tokens is cut into ``2 cp`` chunks of ``T / (2 cp)``;
rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` (a head and a tail), so every rank's queries
see the same number of earlier keys in total and the causal work is even (Megatron-LM and
Llama 3's layout). The rank runs its tokens through the model as one sequence of ``T / cp``:
RoPE rotates them at their global positions, the attention all-gathers the keys and values of
all ranks (``gather_kv``, through ``kiln.components.distributed.all_gather_autograd``: its
backward reduce-scatters the key/value gradients back to their owners) into sequence order, and
the mask (``components/attention/context.py``) lets each query see the keys at or before its
global position (and, with ``document_mask``, of its own document). The loss is each rank's mean
over its tokens; every rank holds the same number, so averaging gradients over the data- and
context-parallel ranks (FSDP2 over ``dp_shard`` x ``cp``) gives the gradient of the global
mean. Nothing in the model changes: context parallel is data (the batch) plus one collective in
attention.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kiln.components import distributed


@dataclass
class ContextParallel:
    """One rank's place in its context-parallel group."""

    group: object  # the process group of the cp ranks (None: the world)
    rank: int  # index in the group
    size: int
    _orders: dict = field(default_factory=dict, repr=False)

    def describe(self) -> str:
        return f"context parallel {self.size} (head + tail chunks per rank, K/V all-gathered)"

    def positions(self, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """This rank's token positions in a row of ``length``: (length / size,) long, ascending
        (the head chunk, then the tail chunk)."""
        return chunk_positions(length, self.size, self.rank, device)

    def gather_kv(self, t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Keys or values (B, T / size, H, D) of every rank -> (B, T, H, D) in sequence order
        (``order``: ``_sequence_order(T)``; ``gatherer`` binds it)."""
        gathered = distributed.all_gather_autograd(t, dim=1, group=self.group)  # rank order
        return gathered.index_select(1, order)

    def gatherer(self, length: int, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
        """``gather_kv`` for rows of ``length`` tokens, its order looked up now, outside the
        model: in a compiled block the cache lookup would be a guard, and the first fill of the
        cache would compile every block twice."""
        return functools.partial(self.gather_kv, order=self._sequence_order(length, device))

    def _sequence_order(self, length: int, device: torch.device) -> torch.Tensor:
        """Where each sequence position sits in the rank-order gather (cached per length)."""
        key = (length, str(device))
        if key not in self._orders:
            held = torch.cat([chunk_positions(length, self.size, r) for r in range(self.size)])
            self._orders[key] = torch.argsort(held).to(device)
        return self._orders[key]


def chunk_positions(length: int, size: int, rank: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions of chunks ``rank`` and ``2 size - 1 - rank`` of ``2 size`` equal chunks."""
    if length % (2 * size):
        raise ValueError(f"a sequence of {length} tokens does not split into 2 x {size} chunks")
    c = length // (2 * size)
    head = torch.arange(rank * c, (rank + 1) * c, device=device)
    tail_start = (2 * size - 1 - rank) * c
    return torch.cat([head, torch.arange(tail_start, tail_start + c, device=device)])


def context_parallel(mesh) -> ContextParallel:
    """The ``cp`` dimension of the trainer's mesh as a ``ContextParallel``."""
    cp = mesh["cp"]
    return ContextParallel(cp.get_group(), cp.get_local_rank(), cp.size())

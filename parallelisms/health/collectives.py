"""The collectives of the start-up health check (``health.py``): each one kiln uses, with inputs
whose result every rank can compute, timed for its bus bandwidth.

Bus bandwidth follows nccl-tests (``doc/PERFORMANCE.md`` there): the bytes ``S`` a collective
moves per rank over its time, times the share of them that crosses links -- 2(n-1)/n for
all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all (``S`` = the whole gathered or
scattered buffer), 1 for broadcast -- so one figure compares with the link speed whatever n.

All values are small integers, exact in float32, so "correct" means equal, not close.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.components import devices, distributed


@dataclass(frozen=True)
class Group:
    """A process group to check: its name in reports, the group (None: the world), its global
    ranks and this process's index in it."""

    name: str
    group: dist.ProcessGroup | None
    ranks: list[int]

    @property
    def size(self) -> int:
        return len(self.ranks)

    def index(self, rank: int) -> int:
        return self.ranks.index(rank)


Run = Callable[[Group, int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Case:
    name: str
    run: Run  # (group, my index, elements per chunk, device) -> (result, expected)
    bus_share: Callable[[int], float]  # n -> share of the bytes that cross links
    chunks: Callable[[int], int]  # n -> chunks of the timed buffer (its bytes = S)


def _all_reduce(g: Group, i: int, k: int, device: torch.device):
    n = g.size
    t = torch.full((k,), float(i + 1), device=device)
    distributed.all_reduce_(t, group=g.group)
    return t, torch.full_like(t, n * (n + 1) / 2)


def _all_gather(g: Group, i: int, k: int, device: torch.device):
    n = g.size
    parts = distributed.all_gather(torch.full((k,), float(i + 1), device=device), group=g.group)
    want = torch.arange(1, n + 1, dtype=torch.float32, device=device).repeat_interleave(k)
    return torch.cat(parts), want


def _reduce_scatter(g: Group, i: int, k: int, device: torch.device):
    n = g.size
    # chunk j of rank s holds (s + 1)(j + 1): chunk i summed over s is (i + 1) n (n + 1) / 2
    scale = torch.arange(1, n + 1, dtype=torch.float32, device=device).repeat_interleave(k)
    out = torch.empty(k, device=device)
    distributed.reduce_scatter_(out, scale * (i + 1), group=g.group)
    return out, torch.full_like(out, (i + 1) * n * (n + 1) / 2)


def _broadcast(g: Group, i: int, k: int, device: torch.device):
    t = torch.full((k,), 7.0 + i, device=device)  # the group's first rank sends 7
    distributed.broadcast_(t, src=g.ranks[0], group=g.group)
    return t, torch.full_like(t, 7.0)


def _all_to_all(g: Group, i: int, k: int, device: torch.device):
    n = g.size
    # rank s sends s * n + j + 1 to rank j: rank i receives s * n + i + 1 from each s
    sent = (torch.arange(n, dtype=torch.float32, device=device) + i * n + 1).repeat_interleave(k)
    out = torch.empty_like(sent)
    distributed.all_to_all_single_(out, sent, [k] * n, [k] * n, group=g.group)
    want = (torch.arange(n, dtype=torch.float32, device=device) * n + i + 1).repeat_interleave(k)
    return out, want


CASES = (
    Case("all-reduce", _all_reduce, lambda n: 2 * (n - 1) / n, lambda n: 1),
    Case("all-gather", _all_gather, lambda n: (n - 1) / n, lambda n: n),
    Case("reduce-scatter", _reduce_scatter, lambda n: (n - 1) / n, lambda n: n),
    Case("broadcast", _broadcast, lambda n: 1.0, lambda n: 1),
    Case("all-to-all", _all_to_all, lambda n: (n - 1) / n, lambda n: n),
)


def check(case: Case, g: Group, rank: int, device: torch.device, size_bytes: int,
          iters: int) -> tuple[str | None, float]:
    """Run ``case`` once to warm up, then ``iters`` timed times on a buffer of ``size_bytes``,
    checking every result. Returns (the first thing that went wrong or None, bus bandwidth in
    bytes/s). A wrong result does not stop the repetitions: every rank must make the same
    collectives, or the next one pairs with the wrong partner and hangs."""
    n, i = g.size, g.index(rank)
    k = max(size_bytes // 4 // case.chunks(n), 1)  # float32 elements per chunk
    elapsed, problem = 0.0, None
    for attempt in range(iters + 1):
        devices.synchronize(device)
        start = time.perf_counter()
        try:
            got, want = case.run(g, i, k, device)
        except Exception as exc:  # a collective that raises (peer gone, timeout): report it
            return f"{case.name} on {g.name} raised {type(exc).__name__}: {exc}", 0.0
        devices.synchronize(device)
        if attempt:
            elapsed += time.perf_counter() - start
        if problem is None and not torch.equal(got, want):
            wrong = (got != want).nonzero()[0].item()
            problem = (f"{case.name} on {g.name} ({n} ranks) returned wrong values: element "
                       f"{wrong} is {got[wrong].item():g}, expected {want[wrong].item():g}")
    moved = k * case.chunks(n) * 4
    return problem, moved / (elapsed / iters) * case.bus_share(n) if elapsed > 0 else 0.0

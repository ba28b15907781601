"""Check that every rank built the same model, cheaply: all-gather a few checksums per tensor.

Ranks that initialise from the same seed must hold bit-identical weights; a rank-dependent seed,
an extra random draw on one rank, or a data race breaks that silently, and the run then trains
a different model on each rank. Broadcasting every weight from rank 0 would fix it, at the cost
of a full-model broadcast; this check detects it instead, for the price of one all-gather of a
few floats per tensor (the 10B reference does the same on a sample of weights).

Covered: plain tensors and replicated DTensors (everything each rank holds in full) and the
CPU / CUDA random number generator states (which decide any initialisation still to come, e.g.
the shards of a meta-device model). Sharded DTensor parameters differ across ranks by design
and are skipped: check before sharding, or rely on the RNG-state part.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from kiln.components import devices, distributed
from kiln.components.errors import KilnError

SAMPLE = 4096  # elements summed per tensor (strided over the whole tensor)


def _digest(t: torch.Tensor) -> torch.Tensor:
    """Two float64 numbers: the sum and a position-weighted sum of a strided sample."""
    flat = t.detach().reshape(-1)
    if flat.numel() == 0:
        return torch.zeros(2, dtype=torch.float64)
    step = max(1, flat.numel() // SAMPLE)
    s = flat[::step][:SAMPLE].to(device="cpu", dtype=torch.float64)
    w = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    return torch.stack([s.sum(), (s * w).sum()])


def fingerprint(model: nn.Module) -> tuple[list[str], torch.Tensor]:
    """Names and float64 checksums (2 per entry) of what every rank should hold identically."""
    names, parts = [], []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if isinstance(t, DTensor):
            if not all(isinstance(p, Replicate) for p in t.placements):
                continue  # a shard: differs across ranks by design
            t = t.to_local()
        if t.is_meta:
            continue
        names.append(name)
        parts.append(_digest(t))
    names.append("<cpu rng state>")
    parts.append(_digest(torch.get_rng_state().to(torch.float64)))
    kind = devices.rng_device_type()  # the accelerator in use, if any
    if kind is not None:
        names.append(f"<{kind} rng state>")
        parts.append(_digest(torch.cat(devices.rng_states(kind)).to(torch.float64)))
    return names, torch.stack(parts)  # (n, 2)


def check_identical_init(model: nn.Module, group: dist.ProcessGroup | None = None) -> str:
    """Raise on every rank if any rank's weights or RNG state differ from rank 0's.

    Returns a one-line summary for the start-up log. A no-op outside a process group.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return "init check: single process"
    names, local = fingerprint(model)
    world = dist.get_world_size(group)
    counts = distributed.all_gather(torch.tensor([local.shape[0]]), group=group)
    if len({int(c) for c in counts}) != 1:
        raise KilnError(
            f"init check: ranks hold different numbers of tensors ({[int(c) for c in counts]}); "
            "every rank must build the same model from the same recipe"
        )
    gathered = distributed.all_gather(local, group=group)
    ref = gathered[0].cpu()
    bad = {}
    for r, other in enumerate(gathered[1:], start=1):
        diff = (other.cpu() != ref).any(dim=1).nonzero().flatten().tolist()
        if diff:
            bad[r] = [names[i] for i in diff]
    if bad:
        detail = "; ".join(f"rank {r}: {', '.join(n[:5])}{' ...' if len(n) > 5 else ''}"
                           for r, n in bad.items())
        raise KilnError(
            f"init check: ranks built different models (differs from rank 0 — {detail}). "
            "Seed every rank with the same training.seed before building the model and do "
            "not draw random numbers rank-dependently before initialisation"
        )
    return f"init check: {len(names)} tensors identical on {world} ranks"

"""Newton–Schulz orthogonalisation for Muon, batched, and its FSDP2-sharded form.

``newton_schulz`` is torch.optim.Muon's quintic iteration (same coefficients, bf16 by default,
Frobenius normalisation, transpose when tall) generalised to a batch of matrices ``(..., m, n)``:
in bf16 it is bit-identical to torch's per-matrix ``_zeropower_via_newtonschulz`` (checked in the
tests), and one call serves a bucket of same-shape matrices or a stack of MoE experts.

``orthogonalize_sharded`` handles FSDP2 parameters (DTensors sharded on dim 0 of a 1-D mesh).
Orthogonalising each row shard on its own is wrong (NS is not row-separable), and letting
DTensor gather every full matrix on every rank (what torch.optim.Muon does implicitly) repeats
all the NS work on every rank. Instead, matrices of one shape are dealt out to owner ranks
round-robin; one ``all_to_all`` brings each owner the row shards of its matrices, the owner runs
one batched NS, and a second ``all_to_all`` sends each rank its rows of the results. DTensor's
own shard-to-shard redistribution would express this, but on CPU process groups it falls back
to all-gather + chunk (measured, torch 2.13), so the two collectives are written out here.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from kiln.components import distributed
from kiln.components.distributed import is_dtensor

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    g: torch.Tensor, coefficients=NS_COEFFICIENTS, steps: int = 5, eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximately orthogonalise each trailing (m, n) matrix of ``g``; returns ``dtype``."""
    a, b, c = coefficients
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = x.unsqueeze(0)
        squeeze = True
    else:
        squeeze = False
        x = x.reshape(-1, *x.shape[-2:])
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= 1
    for _ in range(steps):
        gram = x @ x.mT  # (N, m, m) with m <= n
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b*A + c*A@A
        x = torch.baddbmm(x, poly, x, beta=a)  # a*X + poly@X
    x = x.squeeze(0) if squeeze else x.reshape(*g.shape[:-2], *x.shape[-2:])
    return x.mT if tall else x


def resolve_ns_dtype(setting: str, device: torch.device) -> torch.dtype:
    """Muon's ``ns_dtype`` for matrices on ``device``: ``auto`` is bf16 on accelerators and fp32
    on CPU, where bf16 matmuls without AVX512-BF16 or AMX are emulated (the README's Muon recipe
    ran 3.3x longer in bf16 on an AVX2 EPYC: docs/models.md)."""
    if setting == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[setting]


def lr_scale(rule: str, rows: int, cols: int) -> float:
    """Muon's per-matrix LR factor: Keller's ``original``, Moonlight's ``match_rms_adamw`` or the
    spectral condition's ``spectral``."""
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "spectral":  # a (fan_out, fan_in) matrix: spectral norm sqrt(fan_out / fan_in)
        return math.sqrt(rows / cols)
    raise ValueError(f"unknown Muon lr scaling {rule!r}; valid: original, match_rms_adamw, "
                     "spectral")


def chunk_rows(rows: int, world: int) -> list[int]:
    """Rows per rank under ``Shard(0)`` (torch.chunk semantics, as DTensor and FSDP2 use)."""
    per = -(-rows // world)
    return [max(0, min(per, rows - r * per)) for r in range(world)]


def is_row_sharded(t: torch.Tensor) -> bool:
    """A DTensor sharded on dim 0 of a 1-D mesh: the FSDP2 layout the owner path handles."""
    if not is_dtensor(t):
        return False
    from torch.distributed.tensor import Shard

    return (
        t.device_mesh.ndim == 1
        and len(t.placements) == 1
        and t.placements[0] == Shard(0)
    )


def orthogonalize_sharded(
    shards: list[torch.Tensor],
    shape: tuple[int, int],
    group: dist.ProcessGroup,
    first_owner: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    **ns_kwargs,
) -> list[torch.Tensor]:
    """NS of row-sharded (m, n) matrices given this rank's row shards; returns its result rows.

    Every rank of ``group`` must call this with the same number of matrices in the same order.
    Matrix ``i`` is owned by rank ``(first_owner + i) % world``; callers rotate ``first_owner``
    across shape buckets so that small buckets do not all land on rank 0.
    """
    if not shards:
        return []
    world, me = dist.get_world_size(group), dist.get_rank(group)
    m, n = shape
    rows = chunk_rows(m, world)
    owner = [(first_owner + i) % world for i in range(len(shards))]
    owned = [i for i, o in enumerate(owner) if o == me]
    counts = [owner.count(j) for j in range(world)]
    for s in shards:
        if tuple(s.shape) != (rows[me], n):
            raise RuntimeError(
                f"row shard {tuple(s.shape)} of a {shape} matrix on rank {me} of {world}: "
                f"expected ({rows[me]}, {n}) (dim-0 chunks, FSDP2 layout)"
            )

    # Send: to owner j, my rows of every matrix j owns, in NS's dtype (it casts to it first).
    send = [shards[i].to(dtype).reshape(-1) for j in range(world) for i in range(len(shards))
            if owner[i] == j]
    send_buf = torch.cat(send)
    in_split = [counts[j] * rows[me] * n for j in range(world)]
    out_split = [len(owned) * rows[k] * n for k in range(world)]
    recv_buf = send_buf.new_empty(sum(out_split))
    distributed.all_to_all_single_(recv_buf, send_buf, out_split, in_split, group=group)

    # Reassemble my full matrices: rank k sent (len(owned), rows[k], n) blocks.
    blocks = [p.view(len(owned), rows[k], n) for k, p in enumerate(recv_buf.split(out_split))]
    full = torch.cat(blocks, dim=1)  # (len(owned), m, n)
    ortho = newton_schulz(full, dtype=dtype, **ns_kwargs) if owned else full

    # Return: rank k gets its rows of each matrix I own; I get my rows of every matrix.
    offsets = [sum(rows[:k]) for k in range(world)]
    back = torch.cat([ortho[:, offsets[k] : offsets[k] + rows[k]].reshape(-1)
                      for k in range(world)])
    result = back.new_empty(sum(in_split))
    distributed.all_to_all_single_(result, back, in_split, out_split, group=group)

    mine: list[torch.Tensor] = [shards[0]] * len(shards)
    for j, block in enumerate(result.split(in_split)):
        ids = [i for i in range(len(shards)) if owner[i] == j]
        for i, piece in zip(ids, block.view(len(ids), rows[me], n), strict=True):
            mine[i] = piece
    return mine

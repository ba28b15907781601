"""How a kiln tensor is cut into the Hugging Face tensors that hold it (``Part``) and the RoPE
row order between the two layouts; the families' layouts (``layout``, ``gpt2``) are made of
these."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Part:
    """Rows of a kiln tensor (dim 0) that one Hugging Face tensor holds."""

    hf_name: str
    rows: int
    heads: int = 0  # > 0: the rows are this many RoPE heads, permuted between the layouts
    start: int = 0  # first row of the Hugging Face tensor that this part holds
    # the Hugging Face tensor holds these rows as its columns (GPT-2's Conv1D stores a weight
    # as (in, out), nn.Linear's transpose); ``start`` is then its first column. For a stack of
    # matrices (E, A, B) (MoE experts), a transposed part is one row, its (B, A) transpose.
    transposed: bool = False
    rope_dim: int = 0  # with heads: only each head's first rope_dim rows are permuted (0: all)
    # kiln holds the Hugging Face values plus this (Qwen3-Next's norms scale by 1 + weight;
    # kiln's RMSNorm by its weight, so an import adds 1 and an export takes it off)
    offset: float = 0.0


def hf_shapes(items) -> dict[str, tuple[int, ...]]:
    """The shape of every Hugging Face tensor that ``items``, (kiln tensor shape, its parts)
    pairs, make up, in order of first appearance: one Hugging Face tensor may hold parts of
    several kiln tensors (GPT-2's ``c_attn`` holds wq, wk and wv)."""
    extent: dict[str, int] = {}
    rest: dict[str, tuple[tuple[int, ...], bool]] = {}
    for shape, parts in items:
        for p in parts:  # ``start`` is where the part begins in its Hugging Face tensor
            extent[p.hf_name] = max(extent.get(p.hf_name, 0), p.start + p.rows)
            rest[p.hf_name] = (tuple(shape[1:]) if shape else None, p.transposed)
    out = {}
    for name, n in extent.items():
        others, transposed = rest[name]
        if others is None:
            out[name] = ()
        elif transposed and len(others) == 2:  # one matrix of an (E, A, B) stack: (B, A)
            out[name] = (others[1], others[0])
        else:
            out[name] = (others[0], n) if transposed else (n, *others)
    return out


def to_hf(w: torch.Tensor, heads: int, rope_dim: int = 0) -> torch.Tensor:
    """Rows from kiln's adjacent-pair to Hugging Face's half-split RoPE order, per head (of
    each head's first ``rope_dim`` rows only, when given: partial RoPE)."""
    return _permute(w, heads, rope_dim, to_hf_order=True)


def from_hf(w: torch.Tensor, heads: int, rope_dim: int = 0) -> torch.Tensor:
    """The inverse of ``to_hf``."""
    return _permute(w, heads, rope_dim, to_hf_order=False)


def _permute(w: torch.Tensor, heads: int, rope_dim: int, *, to_hf_order: bool) -> torch.Tensor:
    """Each head's first ``rope_dim`` rows (0: all) read as (R/2, 2), kiln's pairs, or as
    (2, R/2), Hugging Face's halves, and written in the other order; the rest as they are."""
    if not heads:
        return w
    d = w.shape[0] // heads
    r, rest = rope_dim or d, w.shape[1:]
    by_head = w.reshape(heads, d, *rest)
    split = (r // 2, 2) if to_hf_order else (2, r // 2)
    rot = by_head[:, :r].reshape(heads, *split, *rest).transpose(1, 2).reshape(heads, r, *rest)
    return torch.cat([rot, by_head[:, r:]], dim=1).reshape(w.shape)

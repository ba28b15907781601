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


def to_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows from kiln's adjacent-pair to Hugging Face's half-split RoPE order, per head."""
    if not heads:
        return w
    d = w.shape[0] // heads
    return w.reshape(heads, d // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def from_hf(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``to_hf``."""
    if not heads:
        return w
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

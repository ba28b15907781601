"""How many bytes an optimizer's state occupies on this rank (for `kiln bench`)."""

from __future__ import annotations

import torch

from kiln.components.distributed import is_dtensor


def tensor_bytes(t: torch.Tensor, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes held by ``t``: a DTensor's local shard, a tensor subclass's inner tensors (e.g.
    torchao's 8-bit codes and scales), a plain tensor's elements. ``seen`` de-duplicates tensors
    shared between parameters (e.g. a quantisation map)."""
    if is_dtensor(t):
        return tensor_bytes(t.to_local(), seen)
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n), seen) for n in names)
    n = t.numel() * t.element_size()
    if seen is not None and n:
        key = (t.data_ptr(), n)
        if key in seen:
            return 0
        seen.add(key)
    return n


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``optimizer.state`` on this rank (moments, EMA, step counters)."""
    seen: set[tuple[int, int]] = set()
    return sum(
        tensor_bytes(v, seen)
        for state in optimizer.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor)
    )

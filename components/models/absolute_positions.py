"""Learned absolute position embeddings (GPT-2's ``wpe``; Radford et al. 2019): a table of
``max_seq_len`` rows, row ``p`` added to the token embedding at position ``p``.

Positions are those the attention would use: 0..T-1, or the forward's context (a context-parallel
rank's share of the sequence, per-document positions), or, while generating, the new tokens' own
positions in the KV cache session (``kv_cache.attach`` gives this module a cache like an
attention's: it reads the session and stores nothing). The table cannot grow: a sequence or a
generation past ``max_seq_len`` is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.components.attention.context import AttentionContext


class AbsolutePositions(nn.Module):
    """``h + weight[positions]`` for hidden states (B, T, dim)."""

    def __init__(self, max_seq_len: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_seq_len, dim))
        self.kv_cache = None  # set by kv_cache.attach while generating: the new tokens' positions

    def forward(self, h: torch.Tensor, context: AttentionContext | None = None) -> torch.Tensor:
        rows = self.weight.shape[0]
        if self.kv_cache is not None:
            session = self.kv_cache.session
            positions = session.positions  # (B, T)
            # A bound known without reading the positions, else their maximum (left padding)
            bound = session.limit or int(positions.max()) + 1
            if bound > rows:
                raise ValueError(f"learned absolute positions know {rows} positions "
                                 f"(model.max_seq_len); this generation reaches position "
                                 f"{bound - 1}: generate fewer tokens")
        elif context is not None and context.rope_positions is not None:
            positions = context.rope_positions  # (Tq,) or (B, Tq)
        else:
            if h.shape[1] > rows:
                raise ValueError(f"a sequence of {h.shape[1]} tokens; learned absolute positions "
                                 f"know {rows} (model.max_seq_len)")
            positions = torch.arange(h.shape[1], device=h.device)
        return h + F.embedding(positions, self.weight).to(h.dtype)

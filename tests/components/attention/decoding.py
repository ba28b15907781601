"""Cached decoding the way `kiln generate` drives it, for the attention tests."""

from __future__ import annotations

import torch

from kiln.components.attention.kv_cache import attach


def decode(model, ids: torch.Tensor, valid: torch.Tensor | None = None,
           prompt: int = 5) -> torch.Tensor:
    """Logits of ``ids`` fed as a prompt of ``prompt`` tokens (``valid``: False marks left
    padding), then one token at a time through the cache."""
    b, t = ids.shape
    with torch.no_grad(), attach(model, batch=b, max_len=t, device="cpu") as session:
        session.begin(None if valid is None else valid[:, :prompt], tokens=prompt)
        steps = [model(ids[:, :prompt])]
        session.end()
        for i in range(prompt, t):
            session.begin(None)
            steps.append(model(ids[:, i:i + 1]))
            session.end()
    return torch.cat(steps, dim=1)

"""Context-length warmup: train on shorter sequences first, growing to ``seq_len``.

At step ``s`` of a warmup of ``N`` steps the length is ``start + (s / N) * (seq_len - start)``
rounded up to a multiple of ``multiple`` (64: few distinct shapes for torch.compile and the
kernels), never above ``seq_len``; from step ``N`` on it is ``seq_len``. The data loader always
serves full ``seq_len`` windows and the trainer cuts each batch to the current length (inputs and
labels alike, so they stay aligned), as the 10B reference does. Tokens per step therefore grow
during the warmup; the trainer counts the tokens it actually trained on.
"""

from __future__ import annotations

import torch

from kiln.recipes.config.schema import ContextWarmupConfig


def context_length(step: int, seq_len: int, cfg: ContextWarmupConfig) -> int:
    """The training sequence length at optimizer step ``step`` (0-based)."""
    if cfg.steps <= 0 or step >= cfg.steps or cfg.start >= seq_len:
        return seq_len
    raw = int(cfg.start + step / cfg.steps * (seq_len - cfg.start))
    rounded = -(-raw // cfg.multiple) * cfg.multiple
    return min(max(rounded, 1), seq_len)


def truncate(batch: dict[str, torch.Tensor], length: int) -> dict[str, torch.Tensor]:
    """Cut every (B, T) tensor of a batch to its first ``length`` positions."""
    return {k: v[:, :length] if v.ndim >= 2 and v.shape[1] > length else v
            for k, v in batch.items()}

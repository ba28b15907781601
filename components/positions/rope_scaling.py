"""RoPE frequency scaling for context extension: linear (position interpolation), Llama 3.1's
band-wise ``llama3`` rule and YaRN. The formulas are those of Hugging Face ``transformers``'
``modeling_rope_utils`` (the reference the tests compare against), in fp64.

- linear (Chen et al. 2023): every inverse frequency divided by ``factor``.
- llama3 (Llama 3.1): wavelengths shorter than ``original / high_freq_factor`` unchanged, longer
  than ``original / low_freq_factor`` divided by ``factor``, a smooth blend in between.
- yarn (Peng et al. 2023): per-dimension blend between interpolated and original frequencies
  (ramp from ``beta_fast`` to ``beta_slow`` rotations over the original context), and the
  rotation table scaled by ``attention_factor`` (0.1 ln(factor) + 1 unless given), which scales
  q.k by its square.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def base_inverse_frequencies(theta: float, dim: int) -> torch.Tensor:
    """theta ** (-2i / dim) for i < dim / 2, fp64."""
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)


def inverse_frequencies(cfg: Any, dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (dim/2,) fp64, factor applied to the cos/sin table) for a RoPE
    config with ``theta``, ``scaling`` and the scaling fields."""
    inv = base_inverse_frequencies(cfg.theta, dim)
    if cfg.scaling == "none":
        return inv, 1.0
    if cfg.scaling == "linear":
        return inv / cfg.factor, 1.0
    if cfg.scaling == "llama3":
        return _llama3(inv, cfg), 1.0
    if cfg.scaling == "yarn":
        return _yarn(inv, cfg, dim)
    raise ValueError(f"unknown RoPE scaling {cfg.scaling!r}")


def _llama3(inv: torch.Tensor, cfg: Any) -> torch.Tensor:
    old = cfg.original_max_seq_len
    low_wavelen, high_wavelen = old / cfg.low_freq_factor, old / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / cfg.factor, inv)
    smooth = (old / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    blended = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(inv: torch.Tensor, cfg: Any, dim: int) -> tuple[torch.Tensor, float]:
    factor, old = cfg.factor, cfg.original_max_seq_len

    def correction_dim(rotations: float) -> float:  # the dimension that turns `rotations` times
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(cfg.theta))

    low, high = correction_dim(cfg.beta_fast), correction_dim(cfg.beta_slow)
    if cfg.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate
    inv = (inv / factor) * (1 - keep) + inv * keep
    attention = cfg.attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
    return inv, attention

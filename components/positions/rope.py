"""Rotary position embedding (RoPE, Su et al. 2021) in torchtitan llama3's convention.

Adjacent feature pairs (2i, 2i+1) of each head are one complex number rotated by the angle
``pos * theta**(-2i/head_dim)``. This is the Meta / torchtitan layout, not Hugging Face's
"rotate half" layout (which pairs i with i + head_dim/2); an HF export must permute wq/wk rows.
Partial RoPE (``fraction`` < 1) turns the first R = int(head_dim * fraction) features only, as
a head R wide, and passes the others through.

Context extension (``scaling``: linear, llama3, yarn) changes the frequencies and, for YaRN,
the table's magnitude; see ``rope_scaling``. Generation with a KV cache rotates new tokens at
their own positions (``positions``).

In eager mode the rotation is a complex multiply: on CPU one complex kernel (forward + backward)
was ~3x faster than the real-valued stack or swap-and-add forms (measured, (4, 256, 16, 16)
fp32). Under torch.compile the real-valued form is used instead: inductor has no complex codegen
(it warns and falls back to eager kernels) but fuses the real form into its neighbours.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from kiln.components.base import ComponentConfig
from kiln.components.positions.rope_scaling import inverse_frequencies
from kiln.components.registry import register


class RoPEConfig(ComponentConfig):
    theta: float = Field(10000.0, gt=0, description="base of the rotation frequencies")
    scaling: Literal["none", "linear", "llama3", "yarn"] = Field(
        "none", description="context extension: none, linear (position interpolation), llama3 "
        "(Llama 3.1 band-wise), yarn (YaRN); as Hugging Face's rope_type"
    )
    factor: float = Field(1.0, gt=0, description="context extension factor (linear, llama3, yarn)")
    original_max_seq_len: int = Field(
        0, ge=0, description="context length the model was pretrained at (llama3, yarn)"
    )
    low_freq_factor: float = Field(1.0, gt=0, description="llama3: low-frequency band edge")
    high_freq_factor: float = Field(4.0, gt=0, description="llama3: high-frequency band edge")
    beta_fast: float = Field(32.0, gt=0, description="yarn: rotations where the ramp starts")
    beta_slow: float = Field(1.0, gt=0, description="yarn: rotations where the ramp ends")
    attention_factor: float = Field(
        0.0, ge=0, description="yarn: cos/sin scale (0 = 0.1 * ln(factor) + 1)"
    )
    yarn_truncate: bool = Field(True, description="yarn: round the ramp's ends to whole dims")
    fraction: float = Field(
        1.0, gt=0, le=1, description="share of each head's features rotated, the first "
        "int(head_dim * fraction); the rest pass through (partial RoPE: Qwen3-Next's 0.25, "
        "GPT-NeoX's partial_rotary_factor); the frequencies are those of a head that wide")

    @model_validator(mode="after")
    def _check(self) -> RoPEConfig:
        if self.scaling in ("llama3", "yarn") and not self.original_max_seq_len:
            raise ValueError(f"RoPE scaling {self.scaling!r} needs original_max_seq_len (the "
                             "pretrained context length, e.g. 8192 for Llama 3.1)")
        if self.scaling == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(f"llama3 RoPE scaling needs high_freq_factor "
                             f"({self.high_freq_factor}) > low_freq_factor "
                             f"({self.low_freq_factor})")
        return self

    def head_dim_problem(self, head_dim: int, *, width: str = "the head width",
                         keys: str = "dim, attention.n_heads, attention.head_dim") -> str | None:
        """Why a head of width ``head_dim`` cannot be rotated (None: it can); ``width`` names
        that width and ``keys`` the recipe keys that set it, for the message."""
        rotated = self.rotated_dims(head_dim)
        if rotated % 2 or not rotated:
            part = "" if self.fraction == 1.0 else f" times position.fraction ({self.fraction})"
            return (f"rope rotates pairs of dimensions, so {width} ({head_dim}){part} must be "
                    f"even and not zero (it is {rotated}): change {keys} or position.fraction")
        return None

    def rotated_dims(self, head_dim: int) -> int:
        """How many leading features of a head the rotation turns (transformers' rule)."""
        return int(head_dim * self.fraction)


@register("position", "rope")
class RoPE(nn.Module):
    """Rotary position embedding on q and k (adjacent-pair complex rotation, like torchtitan)."""

    Config = RoPEConfig

    def __init__(self, cfg: RoPEConfig, *, head_dim: int, max_seq_len: int) -> None:
        super().__init__()
        problem = cfg.head_dim_problem(head_dim)
        if problem is not None:
            raise ValueError(problem)
        self.cfg = cfg
        self.theta = cfg.theta
        self.head_dim = head_dim
        self.rotated = cfg.rotated_dims(head_dim)  # the leading features turned; the rest pass
        self.max_seq_len = max_seq_len
        # Real (cos, sin) pairs, viewed as complex when applied: a real buffer survives
        # `to_empty`, dtype casts and DTensor wrapping. Not persistent: derived from the config.
        freqs = torch.empty(max_seq_len, self.rotated // 2, 2)  # (T, R/2, [cos, sin])
        self.register_buffer("freqs_cis", freqs, persistent=False)
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """(Re)compute the rotation table, e.g. after `to_empty` from the meta device."""
        buf = self.freqs_cis
        if buf.is_meta:
            return
        # Computed in fp64 on CPU so every device and dtype gets the same table.
        inv_freq, scale = inverse_frequencies(self.cfg, self.rotated)
        angles = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64), inv_freq)
        table = torch.stack((angles.cos(), angles.sin()), dim=-1) * scale  # (T, D/2, 2)
        buf.copy_(table.to(device=buf.device, dtype=buf.dtype))

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor | None = None,
                limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q (B, T, Hq, D) and k (B, T, Hk, D) by their positions: 0..T-1, or
        ``positions`` (B, T) or (T,) long (tokens appended to a KV cache, left-padded rows,
        per-document positions, a context-parallel rank's share of the sequence). ``limit``: the
        caller knows every position is below it (no device-to-host read to check them).

        A position component is called as ``position(q, k, positions=None, limit=None) ->
        (q, k)``; it is `forward`, not `apply`, because `nn.Module.apply(fn)` recurses into
        children.
        """
        t = q.shape[1]
        if positions is not None and limit is None:
            limit = int(positions.max()) + 1
        last = t if positions is None else limit
        if last > self.max_seq_len:
            raise ValueError(
                f"sequence length {last} exceeds the RoPE table ({self.max_seq_len}); raise the "
                "model's max_seq_len"
            )
        if positions is None:
            table = self.freqs_cis[:t].float()  # (T, D/2, 2)
        else:
            table = self.freqs_cis[positions].float()  # (B, T, D/2, 2)
        if self.rotated < self.head_dim:  # partial RoPE: the trailing features as they are
            r = self.rotated
            return (torch.cat([_rotate(q[..., :r], table), q[..., r:]], dim=-1),
                    torch.cat([_rotate(k[..., :r], table), k[..., r:]], dim=-1))
        return _rotate(q, table), _rotate(k, table)

    def extra_repr(self) -> str:
        scaling = "" if self.cfg.scaling == "none" else f", scaling={self.cfg.scaling}"
        if self.rotated < self.head_dim:
            scaling += f", rotated={self.rotated}"
        return (f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, "
                f"theta={self.theta}{scaling}")


def _rotate(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, H, D) by table ([B,] T, D/2, [cos, sin]); fp32 math like torchtitan."""
    if torch.compiler.is_compiling():
        return _rotate_real(x, table)
    rot = torch.view_as_complex(table).unsqueeze(-2)  # ([B,] T, 1, D/2) complex
    xc = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))  # (B, T, H, D/2) complex
    return torch.view_as_real(xc * rot).flatten(-2).type_as(x)


def _rotate_real(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """The same rotation with real ops: (x0, x1) -> (x0 c - x1 s, x0 s + x1 c)."""
    cos, sin = table[..., 0].unsqueeze(-2), table[..., 1].unsqueeze(-2)  # ([B,] T, 1, D/2)
    xr = x.float().unflatten(-1, (-1, 2))  # (B, T, H, D/2, 2)
    x0, x1 = xr[..., 0], xr[..., 1]
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)

"""MXFP4 checkpoints (gpt-oss's released weights: ``quantization_config`` with
``quant_method = "mxfp4"``), dequantized as they are read.

The experts' matrices (``mlp.experts.gate_up_proj`` and ``down_proj``, transformers' (E, in,
out) layout) are stored as ``NAME_blocks`` (E, out, in / 32, 16) uint8, two 4-bit e2m1 values a
byte (low nibble first), and ``NAME_scales`` (E, out, in / 32) uint8, an e8m0 power of two per
block of 32 values (exponent = stored - 127) — the OCP Microscaling format. The real matrix is
value x 2^exponent, stored transposed. A rank that reads some experts (and columns) reads only
those experts' (and columns') blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BLOCKS, SCALES = "_blocks", "_scales"
# The 16 values of an e2m1 nibble: sign bit, two exponent bits, one mantissa bit.
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def applies(config: dict) -> bool:
    return (config.get("quantization_config") or {}).get("quant_method") == "mxfp4"


def packed(names: set[str]) -> dict[str, tuple[str, str]]:
    """Matrix name -> (its blocks, its scales) for every packed pair among stored ``names``."""
    return {n.removesuffix(BLOCKS): (n, n.removesuffix(BLOCKS) + SCALES) for n in names
            if n.endswith(BLOCKS) and n.removesuffix(BLOCKS) + SCALES in names}


def shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The matrix's shape (E, in, out) from its blocks' (E, out, in / 32, 16)."""
    *lead, out, groups, half = blocks_shape
    return (*lead, groups * half * 2, out)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(..., out, G, 16) uint8 blocks and (..., out, G) uint8 scales -> (..., out, G * 32)
    float32 (not yet transposed)."""
    table = torch.tensor(E2M1, dtype=torch.float32)
    b = blocks.to(torch.uint8)
    values = torch.stack([table[(b & 0x0F).long()], table[(b >> 4).long()]], dim=-1)
    values = values.flatten(-2)  # (..., out, G, 32): low nibble first
    exponent = scales.to(torch.int32) - 127
    return torch.ldexp(values, exponent[..., None]).flatten(-2)


def read(read_stored: Callable[[str, tuple[slice, ...]], torch.Tensor],
         names: tuple[str, str], full: tuple[int, ...],
         index: tuple[slice, ...]) -> torch.Tensor:
    """``matrix[index]`` (matrix of shape ``full`` = (E, in, out)) from its blocks and scales,
    reading the experts and output columns asked for (every input row of them: a block spans
    32 inputs)."""
    experts, rows, cols = (list(index) + [slice(None)] * 3)[:3]
    e = slice(*experts.indices(full[0])[:2])
    c = slice(*cols.indices(full[2])[:2])
    blocks = read_stored(names[0], (e, c))
    scales = read_stored(names[1], (e, c))
    return dequantize(blocks, scales).transpose(-1, -2)[:, rows]

"""Block-scaled FP8 checkpoints (DeepSeek-V3's released weights: ``quantization_config`` with
``quant_method = "fp8"`` and ``weight_block_size = [128, 128]``), dequantized as they are read.

Each quantized matrix ``W`` is stored as float8 (e4m3) with a float32 ``W_scale_inv`` of one
number per block of ``weight_block_size`` (the last blocks of a row or column may be short); the
real weight is ``W * scale_inv`` block by block. A rank that reads only some rows and columns of
``W`` reads only the scales of the blocks they fall in.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.components.errors import CheckpointError

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SCALE = "_scale_inv"


def block_size(config: dict, source: str) -> tuple[int, int] | None:
    """(rows, columns) of a block of a block-scaled FP8 config; None for an unquantized one;
    CheckpointError for any other quantization."""
    quant = config.get("quantization_config")
    if quant is None:
        return None
    method, block = quant.get("quant_method"), quant.get("weight_block_size")
    if method == "mxfp4":  # gpt-oss's experts: mxfp4.py
        return None
    if method != "fp8" or not (isinstance(block, list) and len(block) == 2):
        raise CheckpointError(
            f"{source}: config.json field 'quantization_config': {method!r} is not supported; "
            "kiln reads unquantized weights, block-scaled FP8 (quant_method \"fp8\" with a "
            "weight_block_size, DeepSeek-V3's) and MXFP4 (gpt-oss's experts), dequantized on "
            "load")
    return int(block[0]), int(block[1])


def scale_name(name: str) -> str:
    return name + SCALE


def dequantize(data: torch.Tensor, index: tuple[slice, ...], shape: tuple[int, ...],
               block: tuple[int, int], read_scales: Callable[[tuple[slice, ...]], torch.Tensor]
               ) -> torch.Tensor:
    """``data`` = the stored (R, C) float8 matrix's ``[index]`` (up to two slices of a matrix
    of ``shape``) -> float32 weights; ``read_scales(index)`` reads the scales' region."""
    rows, cols = (list(index) + [slice(None)] * 2)[:2]
    (r0, r1, _), (c0, c1, _) = rows.indices(shape[0]), cols.indices(shape[1])
    br, bc = block
    scales = read_scales((slice(r0 // br, (r1 - 1) // br + 1), slice(c0 // bc, (c1 - 1) // bc + 1)))
    grid = scales.float().repeat_interleave(br, 0).repeat_interleave(bc, 1)
    grid = grid[r0 - (r0 // br) * br:, c0 - (c0 // bc) * bc:][:r1 - r0, :c1 - c0]
    return data.float() * grid

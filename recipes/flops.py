"""Peak FLOP/s of the device, for MFU: datasheet numbers on known GPUs, a measured probe on CPU."""

from __future__ import annotations

import functools
import time

import torch

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, from the vendors' datasheets.
GPU_BF16_PEAK = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; PCIe is 756e12
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "B200": 2250e12,
}


@functools.lru_cache(maxsize=4)
def peak_flops(device_type: str, dtype: torch.dtype = torch.float32) -> float:
    """Best-effort peak for MFU. On CPU, measured: a short square-matmul probe in this process
    (the achievable GEMM rate with the current thread count), not a theoretical number."""
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        for key, value in GPU_BF16_PEAK.items():
            if key in name:
                return value
        return 0.0
    if device_type != "cpu":  # no datasheet table for other accelerators: MFU is not reported
        return 0.0
    return matmul_probe(dtype)


def matmul_probe(dtype: torch.dtype = torch.float32, n: int = 1024, seconds: float = 0.25) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)  # warm up
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or iters < 2:
        torch.mm(a, b)
        iters += 1
    elapsed = time.perf_counter() - start
    return 2 * n**3 * iters / elapsed

"""Process-level measurements the trainer reports: start-up phase times and peak memory."""

from __future__ import annotations

import time

import torch

from kiln.components import devices


class Phases:
    """``phase(name)`` records the seconds since the previous call under ``name``."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.last = into, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = self.into.get(name, 0.0) + now - self.last
        self.last = now


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of training on ``device``: tensors allocated on an accelerator (its type's
    counter), the process's peak RSS on the CPU."""
    on_device = devices.peak_memory_bytes(device)
    return peak_rss_bytes() if on_device is None else on_device

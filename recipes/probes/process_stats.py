"""Process-level measurements the trainer reports: start-up phase times and peak memory."""

from __future__ import annotations

import time

import torch

from kiln.components import devices


class Phases:
    """``phase(name)`` records the seconds since the previous call under ``name`` (and, with
    ``rss``, the process's peak RSS at that moment: ``[run.profile]`` on CPU)."""

    def __init__(self, into: dict[str, float], rss: dict[str, int] | None = None) -> None:
        self.into, self.rss, self.last = into, rss, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = self.into.get(name, 0.0) + now - self.last
        if self.rss is not None:
            self.rss[name] = peak_rss_bytes()
        self.last = now


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of training on ``device``: tensors allocated on an accelerator (its type's
    counter), the process's peak RSS on the CPU."""
    on_device = devices.peak_memory_bytes(device)
    return peak_rss_bytes() if on_device is None else on_device


def current_rss_bytes() -> int:
    """Resident set size now (Linux /proc; 0 where it is not available)."""
    import os

    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0

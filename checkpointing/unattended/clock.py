"""The wall clock of an unattended run: ``training.max_hours`` and ``checkpoint.interval_minutes``.

A run inside a scheduler allocation (48 h on SLURM) must stop before the allocation ends, at a
step boundary, with its checkpoint written, so that the same command continues it. The budget
counts from the start of this process (the launcher and queue time before it are not seen:
leave a margin). At each step boundary the run stops when

    elapsed + the longest of the last 50 steps + the time a save takes  >=  max_hours

so the save of the stop lands inside the budget. The time a save takes is the duration of this
process's last save; before its first, the duration of the resume's load (it reads what a save
writes); before either, an estimate from the bytes to write (``estimate_save_s``). Saves are
not counted in the step times.

Time-based checkpoints save when ``interval_minutes`` have passed since the last save (or the
start), whatever the step rate, beside the step interval; they are ordinary snapshots counted in
``keep_last``.

Both decisions are taken by rank 0 alone and followed by every rank (``agree``): clocks of
different hosts differ, and ranks stopping at different steps would hang the next collective.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable

import torch

from kiln.components import distributed

STEP_WINDOW = 50  # recent steps whose longest bounds the next one
WRITE_BYTES_PER_S = 100e6  # assumed write speed for the first save's estimate (a slow share)


def process_age_s() -> float:
    """Seconds since this process started (the interpreter and imports included); 0 where
    /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def estimate_save_s(model: torch.nn.Module) -> float:
    """A first guess of one save before any was timed: this rank's share of the weights plus two
    optimizer moments, written at ``WRITE_BYTES_PER_S``, plus a second of fixed cost."""
    local = (distributed.local_tensor(p) for p in model.parameters())
    weights = sum(t.numel() * t.element_size() for t in local if not t.is_meta)
    return 1.0 + 3 * weights / WRITE_BYTES_PER_S


def agree(flags: list[bool], device: torch.device | None = None) -> list[bool]:
    """Every rank's flags OR-ed together, one all-reduce (the identity in one process). A flag
    only rank 0 sets is thereby rank 0's decision on every rank."""
    if not distributed.is_initialized():
        return list(flags)
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
    distributed.all_reduce_(t, "max")
    return [bool(v) for v in t.tolist()]


class WallClock:
    """Step-boundary decisions against the budget and the save interval (on rank 0)."""

    def __init__(self, max_hours: float = 0.0, interval_minutes: float = 0.0, *,
                 now: Callable[[], float] = time.monotonic, age_s: float | None = None) -> None:
        self.budget_s = max_hours * 3600.0
        self.interval_s = interval_minutes * 60.0
        self.now = now
        self.start = now() - (process_age_s() if age_s is None else age_s)
        self.last_save = self.start
        self.steps: deque[float] = deque(maxlen=STEP_WINDOW)
        self._boundary: float | None = None
        self._saving = 0.0  # seconds of saving since the last boundary (not step time)

    @property
    def active(self) -> bool:
        return bool(self.budget_s or self.interval_s)

    def elapsed(self) -> float:
        return self.now() - self.start

    def begin(self) -> None:
        """Training starts (after the resume): the next step is timed from here."""
        self._boundary = self.now()

    def step_done(self) -> None:
        now = self.now()
        if self._boundary is not None:
            self.steps.append(max(now - self._boundary - self._saving, 0.0))
        self._boundary, self._saving = now, 0.0

    def saved(self, seconds: float) -> None:
        """A save just finished after blocking for ``seconds``."""
        self.last_save = self.now()
        self._saving += seconds

    def save_due(self) -> bool:
        return bool(self.interval_s) and self.now() - self.last_save >= self.interval_s

    def margin(self, save_s: float) -> float:
        """What continuing costs before the run can stop again: one more step, then a save."""
        return max(self.steps, default=0.0) + save_s

    def out_of_time(self, save_s: float) -> bool:
        return bool(self.budget_s) and self.elapsed() + self.margin(save_s) >= self.budget_s

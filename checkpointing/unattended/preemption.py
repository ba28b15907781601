"""SIGTERM / SIGINT: finish the current step, save, exit 0. A second signal exits at once.

Every rank must stop at the same step or the next collective hangs, and a signal may reach only
some ranks (or reach them during different steps). So each rank's flag is all-reduced (max) once
per step (with the wall clock's decisions, ``CheckpointHook``): one tiny collective beside the
step's own all-reduces.
"""

from __future__ import annotations

import os
import signal
import threading

import torch

from kiln.checkpointing.unattended.clock import agree

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    def __init__(self, log=print) -> None:
        self.log = log
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> bool:
        """Install the handlers (main thread only; elsewhere signals stay as they are)."""
        if threading.current_thread() is not threading.main_thread():
            return False
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return True

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            # Second signal: the user (or the scheduler) wants out now. os._exit skips
            # cleanup that could block, e.g. a pending collective.
            os._exit(128 + signum)
        self.signum = signum
        self.log(f"kiln: received {signal.Signals(signum).name}: saving at the end of this step "
                 "and exiting (send it again to exit immediately)")

    def requested(self, device: torch.device | None = None) -> bool:
        """True on every rank if any rank got a signal (one all-reduce when distributed)."""
        return agree([self.signum is not None], device)[0]

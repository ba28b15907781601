"""A background thread that makes micro-batches ahead of the training loop.

``Prefetcher(produce, depth, pin)`` calls ``produce()`` in a daemon thread and keeps up to
``depth`` results in a queue, so file reads, memory-map page faults and Hub downloads happen
while the GPU (or CPU) computes the previous step. ``produce`` returns ``(batch, state)``:
``state`` is the loader position *after* that batch, handed back with it so a checkpoint records
what the trainer consumed, not what the thread has read ahead. With ``pin`` (CUDA present) the
thread also copies each batch into page-locked memory, so the trainer's
``.to(device, non_blocking=True)`` is a real asynchronous copy.

A thread rather than DataLoader worker processes: the producers here are I/O-bound (numpy and
memory maps release the GIL), their state (shard lists, pass queues) must stay in the trainer's
process to be checkpointed, and a thread starts in microseconds. An exception in the thread is
raised by the next ``get()``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import torch

Produce = Callable[[], tuple[dict[str, torch.Tensor], Any]]


class Prefetcher:
    def __init__(self, produce: Produce, depth: int, pin: bool = False) -> None:
        self._produce, self._pin = produce, pin
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kiln-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                batch, state = self._produce()
                if self._pin:
                    batch = {k: v.pin_memory() for k, v in batch.items()}
                item: tuple = (batch, state, None)
            except BaseException as exc:  # handed to the trainer's thread by get()
                item = (None, None, exc)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[2] is not None:
                return

    def get(self) -> tuple[dict[str, torch.Tensor], Any]:
        batch, state, exc = self._queue.get()
        if exc is not None:
            self.close()
            raise exc
        return batch, state

    def close(self) -> None:
        """Stop the thread and drop what it read ahead (the loader re-reads from its state)."""
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._queue.get_nowait()
            except queue.Empty:
                self._thread.join(timeout=0.05)

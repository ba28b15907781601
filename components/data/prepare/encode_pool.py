"""Batched tokenisation in worker processes, results in submission order, bounded in flight.

Each worker process receives the tokenizer once (its initializer's argument) and encodes whole
batches of texts with ``encode_batch``; it returns one concatenated id array plus per-document
token and UTF-8 byte counts, so little crosses the process boundary. At most ``2 * workers``
batches are in flight, which bounds memory whatever the corpus size. ``workers = 0`` encodes in
this process (the ``tokenizers`` library then uses its own threads).

Worker processes are spawned (not forked: the parent may hold torch's or the tokenizer's
thread pools) and each runs one tokenizer thread, so N workers use N cores.

Ctrl-C reaches the whole foreground process group, workers included. Only the parent acts on it
(it stops, shuts the pool down and leaves the partial build to be continued); a worker ignores
SIGINT from birth, so it neither prints a ``KeyboardInterrupt`` traceback nor dies under the
pool, which would leave the parent's shutdown waiting for it.
"""

from __future__ import annotations

import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Any

import numpy as np

_TOKENIZER: Any = None  # the worker's tokenizer, set once by _init


@dataclass
class Encoded:
    """A batch of documents, tokenised: ids back to back plus per-document counts."""

    ids: np.ndarray  # (sum(lengths),) uint16 | uint32, no BOS/EOS
    lengths: np.ndarray  # (docs,) int64 tokens per document
    nbytes: np.ndarray  # (docs,) int64 UTF-8 bytes per document


def encode(tokenizer: Any, texts: list[str], dtype: np.dtype) -> Encoded:
    arrays = tokenizer.encode_batch(texts)
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int64, count=len(arrays))
    ids = np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.empty(0, dtype)
    nbytes = np.fromiter((len(t.encode("utf-8")) for t in texts), dtype=np.int64,
                         count=len(texts))
    return Encoded(ids, lengths, nbytes)


class _WorkerProcess(SpawnProcess):
    """A spawned process that starts with SIGINT blocked: the mask survives fork and exec, so
    a Ctrl-C while the worker is still importing (before ``_init`` runs) is held back instead
    of raising in the middle of an import. The parent's own SIGINT stays pending during the
    start and arrives right after (the stdlib's resource tracker is started the same way)."""

    def start(self) -> None:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            super().start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


class _WorkerContext(SpawnContext):
    Process = _WorkerProcess


def _init(tokenizer: Any) -> None:
    global _TOKENIZER
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C (module doc)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    os.environ["RAYON_NUM_THREADS"] = "1"
    _TOKENIZER = tokenizer  # the parent's own object, sent by multiprocessing's pipe


def _encode_in_worker(texts: list[str], dtype: str) -> Encoded:
    return encode(_TOKENIZER, texts, np.dtype(dtype))


def encode_batches(tokenizer: Any, batches: Iterable[tuple[Any, list[str]]], *, workers: int,
                   dtype: np.dtype) -> Iterator[tuple[Any, Encoded]]:
    """``(tag, Encoded)`` for each ``(tag, texts)`` batch, in order."""
    if workers <= 0:
        for tag, texts in batches:
            yield tag, encode(tokenizer, texts, dtype)
        return
    pool = ProcessPoolExecutor(workers, mp_context=_WorkerContext(), initializer=_init,
                               initargs=(tokenizer,))
    pending: deque[tuple[Any, Future]] = deque()
    try:
        for tag, texts in batches:
            pending.append((tag, pool.submit(_encode_in_worker, texts, np.dtype(dtype).name)))
            if len(pending) >= 2 * workers:
                tag0, fut = pending.popleft()
                yield tag0, fut.result()
        while pending:
            tag0, fut = pending.popleft()
            yield tag0, fut.result()
    finally:
        for _, fut in pending:
            fut.cancel()
        pool.shutdown(wait=True, cancel_futures=True)

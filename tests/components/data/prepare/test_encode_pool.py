"""The tokeniser worker pool leaves Ctrl-C to the parent (the rest is covered by test_prepare)."""

from __future__ import annotations

import signal

import numpy as np
import pytest

from kiln.components.data.prepare.encode_pool import encode_batches
from tests.components.tokenizers.slow_tokenizer import SignalProbeTokenizer


@pytest.fixture
def interruptible():
    """Python's own SIGINT handler here, as in an interactive run: a suite started in the
    background (``pytest &`` in a script) inherits SIGINT ignored, which the workers would
    then inherit too, and the check below would prove nothing."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_workers_ignore_sigint_from_birth(interruptible):
    batches = [(i, ["a", "b"]) for i in range(3)]
    out = list(encode_batches(SignalProbeTokenizer(), batches, workers=2, dtype=np.uint16))
    assert [tag for tag, _ in out] == [0, 1, 2]
    # (ignored, blocked) in every worker: blocked since the spawn, ignored once initialised
    assert all(enc.ids.tolist() == [1, 1, 1, 1] for _, enc in out)
    # ... while this process still gets its KeyboardInterrupt
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])

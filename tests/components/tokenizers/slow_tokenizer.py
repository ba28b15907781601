"""Tokenizers that misbehave on purpose, for the interrupted-build tests: the same ids and
fingerprint as the byte tokenizer, but slow, or failing after a number of batches."""

from __future__ import annotations

import time

from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer


class SlowByteTokenizer(ByteTokenizer):
    """Sleeps in every batch, so a build can be killed midway from another process."""

    def encode_batch(self, texts):
        time.sleep(0.05)
        return super().encode_batch(texts)


class FailingByteTokenizer(ByteTokenizer):
    """Raises (like a crash) in the ``fail_at``-th batch."""

    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at, self.calls = fail_at, 0

    def encode_batch(self, texts):
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt("killed")
        return super().encode_batch(texts)


class SignalProbeTokenizer(ByteTokenizer):
    """Encodes every text as two ids telling how the encoding process treats SIGINT:
    (handler is SIG_IGN, SIGINT is blocked)."""

    def encode_batch(self, texts):
        import signal

        import numpy as np

        state = [signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
                 signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])]
        return [np.array(state, dtype=np.uint16) for _ in texts]

"""Helpers both sides of every row use: the CPU model, process age, a median timer."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class Unavailable(Exception):
    """A side cannot run here (its peer is not installed, or kiln lacks the feature yet): the
    row says so instead of failing the whole table."""


def torchtitan_missing(exc: ImportError) -> Unavailable:
    return Unavailable(f"torchtitan 0.2.x and triton are not importable in {sys.executable} "
                       f"({exc}); see scripts/bench_peers.py")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def process_age() -> float:
    """Seconds since this process started (0 where /proc is missing)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``repeats`` calls of ``fn`` (after none: callers warm up first)."""
    times = []
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def trainers_adamw(params, lr: float):
    """The AdamW both trainers of a fine-tuning row step with by default: fused (kiln's
    ``optimizer.implementation = "auto"``; transformers' ``TrainingArguments.optim`` is
    ``adamw_torch_fused`` on torch >= 2.8, which TRL's trainers inherit). A bare
    ``torch.optim.AdamW`` would run neither's: one parameter at a time on a CPU."""
    import torch

    return torch.optim.AdamW(params, lr=lr, fused=True)


def set_threads(threads: int) -> None:
    import torch

    if threads:
        torch.set_num_threads(threads)


# torchtitan's llama3 debug shape (6,163,712 parameters at seq 256): the dense rows' model
LLAMA_DEBUG = str(REPO / "train_configs" / "llama_debug.toml")


def word_tokenizer():
    """A ``transformers`` tokenizer whose word ``tN`` is id N (N < 258; BOS t256, EOS t257,
    padding t0): TRL's trainers take text, and these words are kiln's byte ids."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(258)}, unk_token="t0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, eos_token="t257", pad_token="t0", bos_token="t256")


def timed_train_steps(forward, params, p: dict, shape: tuple[int, int, int],
                      step_fn=None, foreach: bool = True) -> float:
    """Mean seconds of one training step (forward, fp32 cross-entropy, backward, ``step_fn``,
    AdamW, zero_grad, the loss read on the host) over ``p["steps"]`` after ``p["warmup"]``, on
    seeded random batches of ``shape`` = (batch, seq, vocab). AdamW with foreach kernels, or
    with ``foreach=False`` torch's default on a CPU: one parameter at a time (torch picks foreach
    by itself only on accelerators)."""
    import torch
    import torch.nn.functional as F

    batch, seq, vocab = shape
    opt = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, fused=False,
                            foreach=foreach)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (batch, seq + 1), generator=g)
               for _ in range(p["warmup"] + p["steps"])]
    start = 0.0
    for i, ids in enumerate(batches):
        if i == p["warmup"]:
            start = time.perf_counter()
        logits = forward(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        if step_fn is not None:
            step_fn(opt, i, params)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return (time.perf_counter() - start) / p["steps"]

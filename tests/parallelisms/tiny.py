"""Small models, data and a training loop shared by the parallelism tests."""

from __future__ import annotations

import os
import socket

import torch
import torch.nn.functional as F
from torch import nn

from kiln.components import registry

VOCAB = 96
SEQ = 16


def transformer_config(**overrides):
    cfg = registry.get("model", "transformer").config
    values = {"type": "transformer", "dim": 64, "n_layers": 3, "vocab_size": VOCAB}
    values.update(overrides)
    model_cfg = cfg(**values)
    model_cfg.attention.n_heads = 4
    model_cfg.ffn.hidden_dim = 128
    return model_cfg


def tiny_model(seed: int = 0, meta: bool = False, **overrides) -> nn.Module:
    """The real `transformer` component: dim 64, 3 blocks, 4 heads, SwiGLU 128, vocab 96."""
    cfg = transformer_config(**overrides)
    if meta:
        with torch.device("meta"):
            return cfg.build(vocab_size=VOCAB, seq_len=SEQ)
    torch.manual_seed(seed)
    return cfg.build(vocab_size=VOCAB, seq_len=SEQ)


def pattern_batch(gen: torch.Generator, n: int) -> torch.Tensor:
    """(n, SEQ+1) sequences counting up by a per-sequence stride: learnable in a few steps."""
    start = torch.randint(0, VOCAB, (n, 1), generator=gen)
    stride = torch.randint(1, 4, (n, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def batches(seed: int, steps: int, global_batch: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [pattern_batch(gen, global_batch) for _ in range(steps)]


def loss_fn(model: nn.Module, seqs: torch.Tensor) -> torch.Tensor:
    logits = model(seqs[:, :-1])  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), seqs[:, 1:].flatten())


def free_port() -> int:
    """A port free now, for a test's MASTER_PORT or rendezvous endpoint. On Linux it is drawn
    below the kernel's ephemeral range: a port the kernel handed out (bind to 0) and this
    function released could be handed to another test's outgoing connection (gloo's, in a
    parallel worker) before the test binds it, and both nodes of a rendezvous would then wait
    on a stranger's socket (seen under 5 xdist workers). Only another such pick can take a port
    from below the range, one chance in thousands."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first = int(f.read().split()[0])
    except OSError:  # not Linux: the kernel's pick
        first = 0
    rng = random.Random()  # seeded from the OS, whatever the test seeded
    for _ in range(100 if first > 11000 else 0):
        port = rng.randrange(10000, first)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: draw again
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_vars(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun gives one rank on this host: MASTER_ADDR / MASTER_PORT
    (``free_port()``), RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and OMP_NUM_THREADS=1,
    since the ranks share the machine's cores."""
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
            "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "OMP_NUM_THREADS": "1"}


def rank_env(rank: int, world_size: int, port: int) -> None:
    """Make a ``torch.multiprocessing.spawn`` worker look like one torchrun rank on this host
    (``rank_vars``), with one thread."""
    os.environ.update(rank_vars(rank, world_size, port))
    torch.set_num_threads(1)


def init_gloo(rank: int, world_size: int, port: int) -> None:
    rank_env(rank, world_size, port)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world_size)

"""Task files and a tiny model made in the test: multiple-choice, exact-match and text rows (one
row holds the fields of every kind), JSONL / parquet / Hub-cache copies, a scorer."""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import torch

WORDS = ["the", "cat", "dog", "ran", "sat", "on", "a", "mat", "hat", "big", "small", "red",
         "blue", "house", "tree", "kiln", "fire"]


def rows(n: int = 12, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    out = []
    for i in range(n):
        context = " ".join(r.choice(WORDS) for _ in range(r.randint(4, 12)))
        choices = [" ".join(r.choice(WORDS) for _ in range(r.randint(1, 4)))
                   for _ in range(r.choice([2, 3, 4]))]
        out.append({"context": context, "choices": choices, "answer": r.randrange(len(choices)),
                    "prompt": f"{context}?", "gold": f"#### {i}", "text": context + ". " * i})
    return out


def write_jsonl(path: Path, data: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    return path


def write_parquet(path: Path, data: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(data), path)
    return path


def byte_tokenizer():
    from kiln.components.base import default_config

    return default_config("tokenizer", "byte").build()


def tiny_model(seed: int = 0, max_seq_len: int = 128, **overrides):
    """A random dense kiln transformer for the byte tokenizer, eval mode."""
    from kiln.components.base import default_config

    cfg = default_config("model", "transformer", dim=32, n_layers=2, max_seq_len=max_seq_len,
                         **overrides)
    cfg.attention = default_config("attention", "causal", n_heads=2)
    torch.manual_seed(seed)
    return cfg.build(vocab_size=320, seq_len=max_seq_len).eval()


def scorer(model=None, *, max_len: int = 128, use_cache: bool = True):
    from kiln.components.models.generation import Sampling, generate
    from kiln.components.tasks.scorer import Scorer

    model = model if model is not None else tiny_model(max_seq_len=max_len)
    return Scorer(model, max_len=max_len, vocab_size=258, use_cache=use_cache,
                  generate=functools.partial(generate, sampling=Sampling(temperature=0)))


def task(kind: str, path: Path, name: str = "t", **values):
    from kiln.components.base import default_config

    return default_config("task", kind, path=str(path), **values).build(name=name)

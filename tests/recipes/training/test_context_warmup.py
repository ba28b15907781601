"""Context-length warmup: lengths at known steps, rounding, and batch truncation."""

from __future__ import annotations

import torch

from kiln.recipes.training.context_warmup import ContextWarmupConfig, context_length, truncate


def test_lengths_at_known_steps():
    cfg = ContextWarmupConfig(steps=100, start=256, multiple=64)
    assert context_length(0, 2048, cfg) == 256
    assert context_length(1, 2048, cfg) == 320  # 256 + 17.92 -> 273 -> rounded up to 320
    assert context_length(50, 2048, cfg) == 1152  # 256 + 896
    assert context_length(99, 2048, cfg) == 2048  # 2030 -> 2048
    assert context_length(100, 2048, cfg) == 2048
    assert context_length(10**6, 2048, cfg) == 2048
    lengths = [context_length(s, 2048, cfg) for s in range(101)]
    assert lengths == sorted(lengths) and all(n % 64 == 0 for n in lengths)


def test_off_and_clamped():
    assert context_length(0, 2048, ContextWarmupConfig()) == 2048  # steps = 0: off
    cfg = ContextWarmupConfig(steps=10, start=100, multiple=64)
    assert context_length(9, 1000, cfg) == 960  # 910 rounded up to 960 (below seq_len)
    assert context_length(8, 1000, cfg) == 832  # 820 -> 832
    odd = ContextWarmupConfig(steps=10, start=900, multiple=64)
    assert context_length(5, 1000, odd) == 960  # 950 -> 960, below seq_len: kept
    assert context_length(9, 1000, odd) == 1000  # 990 -> 1024, clamped to seq_len
    assert context_length(3, 200, ContextWarmupConfig(steps=5, start=400)) == 200  # start>=len


def test_truncate_keeps_inputs_and_labels_aligned():
    ids = torch.arange(20).view(2, 10)
    batch = {"input_ids": ids, "labels": ids + 1, "doc_ids": (ids % 10 > 2).int()}
    cut = truncate(batch, 4)
    assert cut["input_ids"].shape == (2, 4)
    assert cut["doc_ids"].tolist() == [[0, 0, 0, 1]] * 2  # the document boundaries go along
    assert torch.equal(cut["labels"], cut["input_ids"] + 1)
    assert truncate(batch, 64)["input_ids"] is ids

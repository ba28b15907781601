from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.components.errors import KilnError
from kiln.parallelisms.meta_init import choose_mode, materialize
from tests.parallelisms.tiny import tiny_model


def test_meta_model_equals_eager_init():
    model = tiny_model(meta=True)
    assert materialize(model, "cpu", seed=5) == "init: full model on each rank"
    ref = tiny_model(seed=5)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert p.device.type == "cpu"
        assert torch.equal(p, q), name
    for (name, b), c in zip(model.named_buffers(), ref.buffers(), strict=True):
        assert torch.equal(b, c), name  # RoPE tables recomputed


def test_init_weights_required():
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(KilnError, match="init_weights"):
        materialize(model, "cpu", seed=0)


class _P:
    def __init__(self, n):
        self.n = n

    def numel(self):
        return self.n


def test_auto_mode_threshold():
    params = {1: (_P(600), []), 2: (_P(500), [])}
    assert choose_mode(params, "auto", 1100) == "replica"
    assert choose_mode(params, "auto", 1099) == "sharded"
    assert choose_mode(params, "sharded", 10**12) == "sharded"

"""bptt_memory: the saved-activation meter and peak memory of segmented steps vs H and K."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.components.base import default_config
from kiln.components.errors import RecipeError
from kiln.components.steps.bptt_memory import (
    SavedTensorMeter,
    loop_memory,
    segment_pass,
)
from kiln.recipes.cli import main
from kiln.recipes.commands.bench import bench_loops
from tests.conftest import CONFIGS

V, T = 40, 12


def model_cfg(**values):
    c = default_config("model", "looped", dim=32, **values)
    c.attention.n_heads = 4
    return c


def test_meter_counts_a_storage_once_and_releases_it():
    x = torch.randn(1000, requires_grad=True)  # 4,000 bytes
    with SavedTensorMeter() as meter:
        y = (x * x).sum()  # mul saves x twice: one storage
        assert meter.live == 4000
        y.backward()
    assert meter.peak == 4000 and meter.live == 0


def test_peak_memory_depends_on_k_not_h():
    rows = loop_memory(model_cfg(n_prelude=1, n_recurrent=1, n_coda=1), vocab_size=V,
                       seq_len=T, batch=2, loops=[4, 8, 16], segment_loops=2)
    peaks = [r["peak_saved_activation_bytes"] for r in rows]
    assert peaks[0] == peaks[1] == peaks[2] > 0
    full = loop_memory(model_cfg(n_prelude=1, n_recurrent=1, n_coda=1), vocab_size=V,
                       seq_len=T, batch=2, loops=[4, 16], segment_loops=0)
    assert full[1]["peak_saved_activation_bytes"] > 2 * full[0]["peak_saved_activation_bytes"]


def test_segment_pass_frees_everything():
    torch.manual_seed(0)
    model = model_cfg(loops=2).build(vocab_size=V, seq_len=T).train()
    ids = torch.randint(0, V, (2, T))
    with SavedTensorMeter() as meter:
        losses = segment_pass(model, ids, ids.roll(-1, 1), 1)
    assert len(losses) == 2 and meter.peak > 0 and meter.live == 0


def test_kiln_bench_loops(capsys):
    small = ["--model.dim=32", "--model.attention.n_heads=2", "--model.ffn.hidden_dim=16",
             "--training.seq_len=16", "--training.micro_batch=2", "--training.global_batch=2"]
    recipe = str(CONFIGS / "looped_moe_debug.toml")
    assert main(["bench", recipe, "--loops", "2,4", "--json", *small]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["loops"] for r in rows] == [2, 4] and rows[0]["segment_loops"] == 2
    assert rows[0]["peak_saved_activation_bytes"] == rows[1]["peak_saved_activation_bytes"]
    with pytest.raises(RecipeError, match="looped model"):
        bench_loops(str(CONFIGS / "debug.toml"), [], "2,4")

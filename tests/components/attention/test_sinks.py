"""Learned attention sinks (gpt-oss): the attention equals transformers' gpt-oss attention on the
same queries, keys, values and sinks (forward and gradients, GQA, with and without a window);
the parameter trains; what cannot hold them says so. Cached decoding and padding are in
test_kv_cache.py, the document mask in test_document_mask.py (the moe family has sinks)."""

from __future__ import annotations

import types

import pytest
import torch

from kiln.components.attention.context import additive, sdpa, visibility
from kiln.components.errors import RecipeError
from kiln.parallelisms.layout.check import model_problems
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS

TINY = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4",
        "--model.attention.n_kv_heads=2", "--model.ffn.hidden_dim=48", "--training.seq_len=16"]


@pytest.mark.parametrize("window", [0, 4])
def test_sinks_equal_transformers_gpt_oss_attention(window):
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    g = torch.Generator().manual_seed(0)
    b, h, hk, t, d = 2, 4, 2, 10, 8
    q, k, v = (torch.randn(b, n, t, d, generator=g).requires_grad_() for n in (h, hk, hk))
    sinks = torch.randn(h, generator=g).requires_grad_()
    module = types.SimpleNamespace(num_key_value_groups=h // hk, sinks=sinks, training=False)
    mask = additive(visibility(t, torch.arange(t), None, window))
    ref, _ = gpt_oss.eager_attention_forward(module, q, k, v, mask, d**-0.5)  # (B, T, H, D)
    ours = sdpa(q, k, v, None, window=window, sinks=sinks).transpose(1, 2)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    inputs = [q, k, v, sinks]
    for a, b_ in zip(torch.autograd.grad(ref.square().sum(), inputs),
                     torch.autograd.grad(ours.square().sum(), inputs), strict=True):
        torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-5)


def test_a_sink_takes_attention_away_and_trains():
    recipe = load_recipe(CONFIGS / "debug.toml", [*TINY, "--model.attention.sinks=true"])
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=258, seq_len=16)
    attn = model.blocks()[0].attention
    assert attn.sinks.shape == (4,) and attn.sinks.std() > 0  # N(0, init_std) as gpt-oss
    ids = torch.randint(0, 258, (2, 16))
    model(ids).logsumexp(-1).mean().backward()
    assert attn.sinks.grad.abs().sum() > 0
    with torch.no_grad():  # a huge sink: every head attends to nothing, the block adds ~0
        q = torch.randn(1, 4, 5, 8)
        kv = torch.randn(1, 2, 5, 8)
        out = sdpa(q, kv, kv, None, sinks=torch.full((4,), 50.0))
    assert out.abs().max() < 1e-12


def test_what_cannot_hold_sinks_says_so():
    with pytest.raises(RecipeError, match="sinks are for causal attention"):
        load_recipe(CONFIGS / "debug.toml", [*TINY, "--model.attention.type=differential",
                                            "--model.attention.sinks=true"])
    recipe = load_recipe(CONFIGS / "debug.toml", [*TINY, "--model.attention.sinks=true"])
    model = recipe.model.build(vocab_size=256, seq_len=16)
    assert any("sinks = true cannot run with parallelism.tp = 2" in p
               for p in model_problems(model, tp=2))

"""Learned attention sinks (gpt-oss): the attention equals transformers' gpt-oss attention on the
same queries, keys, values and sinks (forward and gradients, GQA, with and without a window);
the parameter trains; the CPU flash-kernel path equals the written-out softmax (documents,
bool masks, decoding's last queries, a context-parallel rank's chunks, bf16); what cannot hold
them says so. Cached decoding and padding are in test_kv_cache.py, the document mask in
test_document_mask.py (the moe family has sinks), context parallelism end to end in
tests/parallelisms/test_context_parallel.py."""

from __future__ import annotations

import types

import pytest
import torch

from kiln.components.attention import sinks as sinks_module
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


def _kernel_vs_written_out(q, k, v, mask, sinks, tol):
    """Output and gradients of the kernel path on the inputs against the written-out softmax
    on their fp32 copies (bf16: the kernel's rounding, within ``tol``)."""
    inputs = [q, k, v, sinks]
    exact = [x.detach().float().requires_grad_() for x in inputs]
    ours = sinks_module.sink_attention(q, k, v, mask, sinks)
    ref = sinks_module.written_out(*exact[:3], mask, exact[3])
    torch.testing.assert_close(ours.float(), ref, rtol=tol, atol=tol)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(1))
    for a, b_ in zip(torch.autograd.grad((ref * weights).sum(), exact),
                     torch.autograd.grad((ours.float() * weights).sum(), inputs), strict=True):
        torch.testing.assert_close(b_.float(), a, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", ["documents", "bool_window", "last_queries", "cp_queries",
                                  "bf16"])
def test_the_cpu_kernel_path_equals_the_written_out_softmax(case):
    """The flash kernel with the rescale (sinks.py) against the sink softmax over the scores:
    a per-row document mask, a bool window mask, fewer queries than keys (decoding: the queries
    are the last positions; context parallel: a rank's head and tail chunks over every key,
    with documents), bf16 inputs with fp32 sinks."""
    g = torch.Generator().manual_seed(0)
    b, h, hk, t, d = 2, 4, 2, 12, 8
    q_pos = torch.tensor([0, 1, 2, 9, 10, 11]) if case == "cp_queries" else torch.arange(t)
    tq = 3 if case == "last_queries" else len(q_pos)
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    q = torch.randn(b, h, tq, d, generator=g).to(dtype).requires_grad_()
    k, v = (torch.randn(b, hk, t, d, generator=g).to(dtype).requires_grad_() for _ in range(2))
    sinks = torch.randn(h, generator=g).requires_grad_()
    mask = None
    if case in ("documents", "cp_queries"):
        doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 9 + [1] * 3])
        mask = additive(visibility(t, q_pos, doc_ids, 0))  # (B, 1, Tq, T)
    elif case == "bool_window":
        mask = visibility(t, torch.arange(t), None, 4)
    _kernel_vs_written_out(q, k, v, mask, sinks, 5e-2 if dtype == torch.bfloat16 else 1e-5)


def test_dropout_takes_the_written_out_softmax(monkeypatch):
    def refuse(*args):
        raise AssertionError("the kernel path has no attention dropout")

    monkeypatch.setattr(sinks_module._SinkFlash, "apply", refuse)
    q = torch.randn(1, 2, 4, 8)
    out = sinks_module.sink_attention(q, q, q, None, torch.zeros(2), dropout_p=0.5)
    assert out.shape == q.shape

"""The two-layer MLP: GPT-2's feed-forward (``transformers``' GPT2MLP, tanh GELU, biases) on
the same weights gives the same output and gradients; each activation is what it says; the
default width is 4 * dim; and tensor parallelism has a plan for it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.components.ffn.mlp import MLP, MLPConfig


def _mlp(**kw) -> MLP:
    torch.manual_seed(0)
    m = MLP(MLPConfig(type="mlp", **kw), dim=16, layer_idx=0, n_layers=2)
    m.init_weights(std=0.2, out_std=0.2)
    return m


def test_gpt2s_mlp_on_the_same_weights_gives_the_same_output_and_gradients():
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt2.modeling_gpt2 import GPT2MLP

    ours = _mlp(activation="gelu_tanh", bias=True)
    with torch.no_grad():
        ours.w1.bias.normal_()
        ours.w2.bias.normal_()
    config = transformers.GPT2Config(n_embd=16, n_inner=64, activation_function="gelu_new",
                                     resid_pdrop=0.0)
    theirs = GPT2MLP(64, config)
    with torch.no_grad():  # GPT-2's Conv1D holds (in, out): the transpose of nn.Linear's
        theirs.c_fc.weight.copy_(ours.w1.weight.t())
        theirs.c_fc.bias.copy_(ours.w1.bias)
        theirs.c_proj.weight.copy_(ours.w2.weight.t())
        theirs.c_proj.bias.copy_(ours.w2.bias)
    x = torch.randn(3, 5, 16, requires_grad=True)
    a, b = ours(x), theirs(x)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    ga = torch.autograd.grad(a.square().sum(), [x, ours.w1.weight, ours.w2.bias])
    gb = torch.autograd.grad(b.square().sum(), [x, theirs.c_fc.weight, theirs.c_proj.bias])
    torch.testing.assert_close(ga[0], gb[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ga[1], gb[1].t(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ga[2], gb[2], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation, reference", [
    ("gelu", F.gelu), ("relu", F.relu), ("relu2", lambda h: F.relu(h) ** 2),
    ("gelu_tanh", lambda h: 0.5 * h * (1 + torch.tanh(0.7978845608 * (h + 0.044715 * h ** 3))))])
def test_each_activation_is_what_it_says(activation, reference):
    m = _mlp(activation=activation)
    x = torch.randn(4, 16)
    torch.testing.assert_close(m(x), m.w2(reference(m.w1(x))), rtol=1e-5, atol=1e-6)


def test_the_default_width_is_four_times_dim_and_biases_start_at_zero():
    m = _mlp(bias=True)
    assert m.hidden_dim == 64 and m.w1.weight.shape == (64, 16)
    assert not m.w1.bias.any() and not m.w2.bias.any()
    assert _mlp().w1.bias is None and _mlp(hidden_dim=24).w2.weight.shape == (16, 24)


def test_tensor_parallel_plans_it_like_swiglu_without_the_gate():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from kiln.parallelisms.tensor_parallel import _ffn_plan

    plan, f8 = _ffn_plan(_mlp(bias=True), "off", None, None)
    assert not f8 and set(plan) == {"feed_forward", "feed_forward.w1", "feed_forward.w2"}
    assert isinstance(plan["feed_forward.w1"], ColwiseParallel)
    assert isinstance(plan["feed_forward.w2"], RowwiseParallel)

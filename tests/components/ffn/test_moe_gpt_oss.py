"""gpt-oss's MoE from kiln's ``moe`` feed-forward (``experts = "gpt_oss"``, a router bias,
softmax gates renormalised over the top k): equal to transformers' ``GptOssMLP`` on the same
weights, forward and gradients, with inputs large enough for the clamps to act; expert
parallel refuses it."""

from __future__ import annotations

import pytest
import torch

from kiln.components.ffn.moe import MoEConfig
from kiln.parallelisms.layout.check import model_problems
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS

DIM, E, K, HIDDEN = 32, 4, 2, 16


def _moe(dispatch: str = "auto"):
    cfg = MoEConfig(type="moe", n_experts=E, top_k=K, hidden_dim=HIDDEN, experts="gpt_oss",
                    router_bias=True, bias_update_coeff=0.0, dispatch=dispatch)
    torch.manual_seed(0)
    moe = cfg.build(dim=DIM, layer_idx=0, n_layers=1)
    moe.init_weights(0.5, 0.5)
    with torch.no_grad():
        for bias in (moe.router.bias, moe.b13, moe.b2):
            bias.normal_(std=0.5)
    return moe.eval()


@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
def test_equals_transformers_gpt_oss_mlp(dispatch):
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    moe = _moe(dispatch)
    config = GptOssConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_local_experts=E,
                          num_experts_per_tok=K)
    ref = gpt_oss.GptOssMLP(config).eval()
    ref.load_state_dict({
        "router.weight": moe.router.weight.detach(), "router.bias": moe.router.bias.detach(),
        "experts.gate_up_proj": moe.w13.detach(), "experts.gate_up_proj_bias": moe.b13.detach(),
        "experts.down_proj": moe.w2.detach(), "experts.down_proj_bias": moe.b2.detach()})
    x = 4 * torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(1))
    x.requires_grad_()
    ours, (theirs, _) = moe(x), ref(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # the clamps act on these inputs (else they would go untested)
        h = x.reshape(-1, DIM) @ moe.w13[0] + moe.b13[0]
    assert (h[..., ::2] > 7).any() and (h[..., 1::2].abs() > 7).any()
    (g_ours,) = torch.autograd.grad(ours.square().sum(), x)
    (g_theirs,) = torch.autograd.grad(theirs.square().sum(), x)
    assert (g_ours - g_theirs).norm() <= 1e-5 * g_theirs.norm()


def test_it_trains_in_a_model_and_expert_parallel_refuses_it():
    recipe = load_recipe(CONFIGS / "debug.toml", [
        "--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=4",
        "--model.ffn.type=moe", "--model.ffn.experts=gpt_oss", "--model.ffn.router_bias=true",
        "--model.ffn.n_experts=4", "--model.ffn.hidden_dim=16", "--training.seq_len=16"])
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=258, seq_len=16)
    model(torch.randint(0, 258, (2, 16))).logsumexp(-1).mean().backward()
    moe = model.blocks()[0].feed_forward
    assert all(p.grad.abs().sum() > 0 for p in (moe.w13, moe.b13, moe.w2, moe.b2,
                                                  moe.router.bias))
    assert any("experts = \"gpt_oss\" cannot run with parallelism.ep = 2" in p
               for p in model_problems(model, tp=1, ep=2))

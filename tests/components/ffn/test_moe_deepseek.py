"""DeepSeek-V3's MoE from kiln's ``moe`` feed-forward: sigmoid scores, the balancing bias
choosing the experts (the gates unbiased, renormalised, scaled), group-limited routing and a
shared expert equal transformers' ``DeepseekV3MoE`` on the same weights, forward and gradients;
each token routes within its two best groups (the groups change the choice); impossible group
settings are one clear line."""

from __future__ import annotations

import pytest
import torch

from kiln.components.errors import RecipeError
from kiln.components.ffn.moe import MoEConfig
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS

DIM, E, K, HIDDEN = 32, 8, 3, 16


def _moe(groups: int = 4, topk_groups: int = 2):
    cfg = MoEConfig(type="moe", n_experts=E, top_k=K, hidden_dim=HIDDEN, score="sigmoid",
                    route_scale=2.5, n_shared_experts=1, n_groups=groups,
                    topk_groups=topk_groups)
    torch.manual_seed(0)
    moe = cfg.build(dim=DIM, layer_idx=0, n_layers=1)
    moe.init_weights(0.3, 0.3)
    with torch.no_grad():  # a bias that changes the choice
        moe.expert_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(5)) * 0.3)
    return moe.eval()


def _deepseek(moe):
    ds = pytest.importorskip("transformers.models.deepseek_v3.modeling_deepseek_v3")
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(hidden_size=DIM, n_routed_experts=E, num_experts_per_tok=K,
                              moe_intermediate_size=HIDDEN, n_shared_experts=1,
                              n_group=moe.cfg.n_groups, topk_group=moe.cfg.topk_groups,
                              routed_scaling_factor=2.5, norm_topk_prob=True)
    ref = ds.DeepseekV3MoE(config).eval()
    shared = moe.shared
    ref.load_state_dict({
        "gate.weight": moe.router.weight.detach(),
        "gate.e_score_correction_bias": moe.expert_bias.clone(),
        "experts.gate_up_proj": torch.cat([moe.w1, moe.w3], dim=2).transpose(1, 2).detach(),
        "experts.down_proj": moe.w2.transpose(1, 2).detach(),
        "shared_experts.gate_proj.weight": shared.w1.weight.detach(),
        "shared_experts.up_proj.weight": shared.w3.weight.detach(),
        "shared_experts.down_proj.weight": shared.w2.weight.detach()})
    return ref


@pytest.mark.parametrize("groups, topk_groups", [(4, 2), (1, 1)])
def test_equals_transformers_deepseek_v3_moe(groups, topk_groups):
    moe = _moe(groups, topk_groups)
    ref = _deepseek(moe)
    x = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(1), requires_grad=True)
    ours, theirs = moe(x), ref(x)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    (g_ours,) = torch.autograd.grad(ours.square().sum(), x)
    (g_theirs,) = torch.autograd.grad(theirs.square().sum(), x)
    assert (g_ours - g_theirs).norm() <= 1e-5 * g_theirs.norm()


def test_each_token_routes_within_its_best_groups():
    moe = _moe(groups=4, topk_groups=2)
    x = torch.randn(64, DIM, generator=torch.Generator().manual_seed(2))
    idx, _, _ = moe.route(x)
    assert all(len(set((row // 2).tolist())) <= 2 for row in idx)  # groups of 2 experts
    free, _, _ = _moe(groups=1, topk_groups=1).route(x)
    assert not torch.equal(idx.sort(-1).values, free.sort(-1).values)  # the groups mattered


def test_impossible_groups_are_one_clear_line():
    base = ["--model.ffn.type=moe", "--model.ffn.n_experts=8", "--model.ffn.top_k=3"]
    with pytest.raises(RecipeError, match="equal groups of at least 2"):
        load_recipe(CONFIGS / "debug.toml", [*base, "--model.ffn.n_groups=3"])
    with pytest.raises(RecipeError, match="cannot hold top_k = 3"):
        load_recipe(CONFIGS / "debug.toml", [*base, "--model.ffn.n_groups=4",
                                             "--model.ffn.topk_groups=1"])
    with pytest.raises(RecipeError, match="topk_groups needs n_groups > 1"):
        load_recipe(CONFIGS / "debug.toml", [*base, "--model.ffn.topk_groups=2"])

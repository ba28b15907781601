"""MoE ffn: routing with a selection-only bias, dispatch against a dense reference, balancing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from kiln.components.base import default_config
from kiln.components.ffn.moe import MoE, balance_step
from kiln.components.ffn.moe_model import MoEModelMixin, moe_metrics, pop_aux_loss


def make(dim=16, **values) -> MoE:
    torch.manual_seed(0)
    return default_config("ffn", "moe", **values).build(dim=dim, layer_idx=0, n_layers=1)


def dense_reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: score every expert, pick top-k on score + bias, weight unbiased scores."""
    flat = x.reshape(-1, x.shape[-1]).float()
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        logits = m.router.weight.float() @ flat[t]
        s = logits.softmax(-1) if m.cfg.score == "softmax" else logits.sigmoid()
        chosen = torch.topk(s + m.expert_bias, m.top_k).indices
        g = s[chosen]
        if m.cfg.renormalize and m.top_k > 1:
            g = g / g.sum()
        for e, w in zip(chosen.tolist(), (g * m.cfg.route_scale).tolist(), strict=True):
            h = F.silu(flat[t] @ m.w1[e]) * (flat[t] @ m.w3[e])
            out[t] += w * (h @ m.w2[e])
        if m.shared is not None:
            gate = torch.sigmoid(m.shared_gate.weight @ flat[t]) if m.cfg.shared_gate else 1.0
            out[t] += gate * m.shared(flat[t])
    return out.view_as(x)


@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
@pytest.mark.parametrize("opts", [
    dict(score="softmax"),
    dict(score="sigmoid", route_scale=2.5),
    dict(score="softmax", renormalize=False, top_k=3),
    dict(score="sigmoid", n_shared_experts=1),
    dict(score="softmax", n_shared_experts=1, shared_hidden_dim=24, shared_gate=True),
    dict(score="softmax", top_k=1),
])
def test_matches_dense_reference(dispatch, opts):
    m = make(n_experts=6, dispatch=dispatch, **{"top_k": 2, **opts})
    m.expert_bias.copy_(torch.linspace(-0.05, 0.05, 6))
    x = torch.randn(3, 7, 16)  # any batch: 21 tokens, uneven per expert
    torch.testing.assert_close(m(x), dense_reference(m, x), rtol=1e-5, atol=1e-5)


def test_grouped_and_loop_agree_in_backward():
    x = torch.randn(2, 9, 16)
    grads = []
    for dispatch in ("grouped", "loop"):
        m = make(n_experts=4, dispatch=dispatch)
        xi = x.clone().requires_grad_()
        m(xi).sum().backward()  # .sum() hands _grouped_mm an expanded gradient
        grads.append([xi.grad, m.w1.grad, m.w2.grad, m.w3.grad, m.router.weight.grad])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_empty_experts_and_single_token():
    m = make(n_experts=8, top_k=2)
    y = m(torch.randn(1, 1, 16))  # 6 of 8 experts get no token
    assert y.shape == (1, 1, 16) and torch.isfinite(y).all()


def test_bias_changes_selection_but_not_gate_values():
    m = make(n_experts=4, top_k=1, score="sigmoid", renormalize=False)
    x = torch.randn(64, 16)
    idx0, gates0, scores = m.route(x)
    m.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # force expert 0
    idx1, gates1, scores1 = m.route(x)
    assert (idx1 == 0).all() and not (idx0 == 0).all()
    torch.testing.assert_close(scores1, scores)
    # The gate of expert 0 is its unbiased score, not score + 10.
    torch.testing.assert_close(gates1[:, 0], scores[:, 0])
    kept = idx0[:, 0] == 0
    torch.testing.assert_close(gates1[kept], gates0[kept])


def test_bias_moves_toward_balance_and_stays_on_skipped_steps():
    m = make(n_experts=4, top_k=1, bias_update_coeff=0.02, score="sigmoid")
    with torch.no_grad():
        m.router.weight.normal_(std=0.3)
        m.router.weight[0] += 0.3  # expert 0 wins every token with positive features
    x = torch.randn(128, 16).abs()
    m.train()

    def load():
        m.discard_load()
        m(x)
        return m.tokens_per_expert.clone()

    first = load()
    assert first[0] == 128  # fully skewed
    m(x)
    balance_step([m], skipped=True)  # a skipped step: loads dropped, bias unchanged
    assert m.expert_bias.abs().sum() == 0 and m.tokens_per_expert.sum() == 0
    for _ in range(60):
        m(x)
        m.on_global_step(skipped=False)
    assert m.expert_bias[0] < 0 and abs(float(m.expert_bias.sum())) < 1e-5  # re-centred
    for _ in range(2):  # the sign update oscillates around balance: check two phases
        final = load()
        assert final.max() / final.mean() < 1.25, final
        m.on_global_step(skipped=False)
    before = m.expert_bias.clone()
    m(x)
    m.on_global_step(skipped=True)
    torch.testing.assert_close(m.expert_bias, before)


def test_counts_only_in_training_and_not_twice_under_activation_checkpointing():
    m = make(n_experts=4, top_k=2)
    x = torch.randn(2, 8, 16, requires_grad=True)
    m.eval()
    m(x)
    assert m.tokens_per_expert.sum() == 0
    m.train()
    checkpoint(m, x, use_reentrant=False).sum().backward()  # recompute runs in backward
    assert m.tokens_per_expert.sum() == 2 * 8 * 2


def test_capacity_drops_assignments_and_reports_them():
    m = make(n_experts=4, top_k=1, capacity_factor=1.0)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0] += 1.0
    m.train()
    x = torch.randn(1, 32, 16).abs()
    y = m(x)
    # Capacity ceil(1.0 * 32 / 4) = 8: the first 8 tokens (stable order) get expert 0.
    assert (y[0, 8:] == 0).all() and (y[0, :8] != 0).any()
    m.on_global_step(skipped=False)
    metrics = moe_metrics([m])
    assert metrics["moe/layer0/dropped"] == pytest.approx(24 / 32)
    assert metrics["moe/layer0/max_load"] == pytest.approx(4.0)
    assert metrics["moe/layer0/min_load"] == 0.0


def test_a_capacity_above_every_token_drops_nothing():
    """capacity_factor = 1e30 raised OverflowError (int too big to convert) in the first step."""
    x = torch.randn(2, 8, 16)
    free, huge = make(n_experts=4, top_k=2), make(n_experts=4, top_k=2, capacity_factor=1e30)
    huge.train()
    torch.testing.assert_close(huge(x), free(x))
    assert huge.dropped == 0


def test_sequence_aux_loss_is_popped_and_has_gradient():
    m = make(n_experts=4, top_k=2, aux_loss_coeff=0.01)
    m.train()
    x = torch.randn(2, 8, 16)
    m(x)
    m(x)  # called twice (e.g. a looped block): the losses add up
    aux = pop_aux_loss([m])
    assert aux is not None and aux.item() > 0 and m.aux_loss is None
    aux.backward()
    assert m.router.weight.grad is not None and m.router.weight.grad.abs().sum() > 0
    # Perfectly uniform routing gives alpha * k... f_i = 1, P_i = 1/E: sum = 1 per sequence.
    with torch.no_grad():
        m.router.weight.zero_()
    m(torch.randn(1, 8, 16))
    assert pop_aux_loss([m]).item() == pytest.approx(0.01, rel=1e-5)


def test_bf16_autocast_runs_both_kernels():
    for dispatch in ("grouped", "loop"):
        m = make(n_experts=4, dispatch=dispatch)
        x = torch.randn(2, 5, 16, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = m(x)
        y.float().sum().backward()
        assert y.dtype == x.dtype and torch.isfinite(x.grad).all()


def test_model_mixin_collects_layers():
    class Tiny(MoEModelMixin, torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = make(n_experts=4), make(n_experts=4)

    model = Tiny()
    model.train()
    x = torch.randn(1, 4, 16)
    model.b(model.a(x))
    model.on_global_step(skipped=False)
    assert model.a.expert_bias.abs().sum() > 0
    assert "moe/max_load" in model.metrics() and model.pop_aux_loss() is None


def test_active_params():
    m = make(dim=16, n_experts=8, top_k=2, hidden_dim=32, n_shared_experts=1)
    per_expert = 3 * 16 * 32
    assert m.active_params() == 8 * 16 + 2 * per_expert + per_expert
    assert sum(p.numel() for p in m.parameters()) == 8 * 16 + 8 * per_expert + per_expert
    gated = make(dim=16, n_experts=8, top_k=2, hidden_dim=32, n_shared_experts=1,
                 shared_gate=True)  # the shared expert's gate: one weight per feature
    assert gated.active_params() == m.active_params() + 16


def test_a_shared_gate_needs_a_shared_expert():
    with pytest.raises(ValueError, match="shared_gate gates the shared expert: set "
                       "n_shared_experts >= 1"):
        make(shared_gate=True)


def test_a_transformer_recipe_can_use_moe_ffns():
    c = default_config("model", "transformer", dim=16, n_layers=2,
                       attention=default_config("attention", "causal", n_heads=2))
    c.ffn = default_config("ffn", "moe", n_experts=4, top_k=2, aux_loss_coeff=0.01)
    torch.manual_seed(0)
    model = c.build(vocab_size=20, seq_len=8).train()
    ids = torch.randint(0, 20, (2, 8))
    loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    aux = model.pop_aux_loss()
    assert aux is not None and model.pop_aux_loss() is None  # popped once per forward
    (loss + aux).backward()
    model.on_global_step(skipped=False)
    layers = [b.feed_forward for b in model.blocks()]
    assert all(m.expert_bias.abs().sum() > 0 for m in layers)
    assert {"moe/layer0/max_load", "moe/layer1/entropy"} <= set(model.metrics())


class _ScaledMoE(torch.nn.Module):
    """MoE followed by a LayerScale-like multiply: something after the MoE saves tensors."""

    def __init__(self, m: MoE) -> None:
        super().__init__()
        self.moe, self.scale = m, torch.nn.Parameter(torch.full((16,), 0.5))

    def forward(self, x):
        return self.moe(x) * self.scale


@pytest.mark.parametrize("op_level", [False, True], ids=["full", "op_level"])
def test_checkpointed_moe_with_aux_loss_trains_micro_batches(op_level):
    """Issue 10 item 1: the first MoE forward inside a checkpointed region ran the _grouped_mm
    probe there (recompute saved a different number of tensors), and the recompute registered
    the aux loss again (the next micro-batch backpropagated through a freed graph)."""
    import functools

    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from kiln.components.ffn import moe_dispatch
    from kiln.parallelisms.activation_checkpoint import save_list

    kwargs = {"use_reentrant": False}
    if op_level:
        kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts,
                                                 save_list())
    grads = []
    for wrapped in (False, True):
        moe_dispatch.grouped_mm_works.cache_clear()  # the first call happens in the region
        net = _ScaledMoE(make(n_experts=4, aux_loss_coeff=0.1))
        torch.manual_seed(3)
        for _ in range(2):  # two micro-batches
            x = torch.randn(2, 6, 16, requires_grad=True)
            y = checkpoint(net, x, **kwargs) if wrapped else net(x)
            registered = net.moe.aux_loss
            (y.square().mean() + registered).backward()
            assert net.moe.aux_loss is registered  # the recompute did not add another copy
            net.moe.aux_loss = None  # what pop_aux_loss does
        grads.append([p.grad for p in net.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)
    assert moe_dispatch.grouped_mm_works(torch.device("cpu"), torch.float32)


def test_kernel_probe_ignores_no_grad_and_keeps_the_rng():
    """An evaluation first (under no_grad) made the probe fail and chose the loop kernel for
    the rest of the process; and the probe drew from the global RNG."""
    from kiln.components.ffn import moe_dispatch

    moe_dispatch.grouped_mm_works.cache_clear()
    state = torch.get_rng_state()
    with torch.no_grad():
        assert moe_dispatch.grouped_mm_works(torch.device("cpu"), torch.float32)
    assert torch.equal(state, torch.get_rng_state())
    model = MoEModelMixinModel()
    line = model.resolve_kernels(torch.device("cpu"), torch.float32)
    assert line == "MoE expert kernel grouped (torch._grouped_mm) on cpu float32 (dispatch = auto)"
    model.layers[1].cfg = model.layers[1].cfg.model_copy(update={"dispatch": "loop"})
    assert "grouped (torch._grouped_mm) + loop (one matmul per expert)" in model.resolve_kernels(
        torch.device("cpu"), torch.float32)
    assert MoEModelMixinModel(n=0).resolve_kernels(torch.device("cpu"), torch.float32) == ""
    model = MoEModelMixinModel()  # compiled fp32 traces no _grouped_mm: the line says the loop
    assert model.resolve_kernels(torch.device("cpu"), torch.float32, compiling=True) == (
        "MoE expert kernel loop (one matmul per expert) on cpu float32 compiled (dispatch = auto)")


class MoEModelMixinModel(MoEModelMixin, torch.nn.Module):
    def __init__(self, n: int = 2) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([make() for _ in range(n)])


def test_renormalize_is_documented_as_it_behaves():
    """Issue 10 item 11: the field said the gates sum to 1, but top_k = 1 keeps the score."""
    from kiln.components.ffn.moe import MoEConfig

    text = MoEConfig.model_fields["renormalize"].description
    assert "top_k > 1" in text and "top_k = 1" in text
    x = torch.randn(10, 16)
    one = make(n_experts=4, top_k=1, renormalize=True, score="sigmoid")
    idx, gates, scores = one.route(x)
    torch.testing.assert_close(gates, scores.gather(-1, idx))  # not 1
    two = make(n_experts=4, top_k=2, renormalize=True, score="sigmoid")
    torch.testing.assert_close(two.route(x)[1].sum(-1), torch.ones(10))

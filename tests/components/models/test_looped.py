"""The looped model: equivalence with a block stack, loop windows, H_eff, lambda, carry."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.components.base import default_config
from kiln.components.errors import CheckpointError
from kiln.components.models.looped import Looped

V, T = 40, 12


def cfg(**values):
    c = default_config("model", "looped", dim=32, **values)
    c.attention.n_heads = 4
    return c


def build(seed=0, **values) -> Looped:
    torch.manual_seed(seed)
    return cfg(**values).build(vocab_size=V, seq_len=T)


def ids(b=2, seed=1):
    return torch.randint(0, V, (b, T), generator=torch.Generator().manual_seed(seed))


def test_one_loop_without_prelude_or_coda_is_a_plain_block_stack():
    m = build(n_prelude=0, n_recurrent=3, n_coda=0, loops=1)
    t = default_config("model", "transformer", dim=32, n_layers=3)
    t.attention.n_heads = 4
    dense = t.build(vocab_size=V, seq_len=T)
    dense.load_state_dict(m.state_dict())  # same names: tok_embeddings, layers.N, norm, output
    x = ids()
    torch.testing.assert_close(m(x), dense(x), rtol=0, atol=0)
    h = m.tok_embeddings(x)
    for block in m.blocks():
        h = block(h)
    torch.testing.assert_close(m(x), m.output(m.norm(h)), rtol=0, atol=0)


def manual(m: Looped, x, loops, lam=1.0):
    e = m.tok_embeddings(x)
    for i in m.prelude_ids:
        e = m.layers[i](e)
    s = torch.zeros_like(e)
    for _ in range(loops):
        u = lam * s + e
        for i in m.recurrent_ids:
            u = m.layers[i](u)
        s = u
    for i in m.coda_ids:
        s = m.layers[i](s)
    return m.output(m.norm(s))


@pytest.mark.parametrize("h", [1, 2, 3, 4])
def test_eval_at_any_loop_count_with_the_same_weights(h):
    m = build(loops=4, loop_scale_init=0.7).eval()
    x = ids()
    torch.testing.assert_close(m(x, loops=h), manual(m, x, h, lam=0.7), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="loops must be"):
        m(x, loops=5)


def test_windows_chain_to_the_full_forward():
    m = build(loops=5).train()
    x = ids()
    full = m(x)
    with m.loop_window(0, 2) as w1:
        m(x)
    with m.loop_window(2, 5, state=w1.state_out) as w2:
        chained = m(x)
    torch.testing.assert_close(chained, full, rtol=0, atol=0)
    assert w2.state_out.shape == (2, T, 32)
    # A window after loop 0 needs the incoming state.
    with pytest.raises(ValueError, match="bad loop window"), m.loop_window(1, 3):
        pass


def test_adapter_injection_starts_as_the_sum():
    a, b = build(injection="adapter"), build(injection="add")
    b_state = {k: v for k, v in a.state_dict().items() if not k.startswith("adapter")}
    b.load_state_dict(b_state)
    x = ids()
    torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-5)
    a(x).sum().backward()
    assert a.adapter.weight.grad.abs().sum() > 0


def test_learned_loop_scale_is_bounded_and_trained():
    m = build(loop_scale="learned", loop_scale_init=0.5, loop_scale_max=1.0)
    assert float(m.loop_scale().detach()) == pytest.approx(0.5)
    F.cross_entropy(m(ids()).flatten(0, 1), ids(seed=2).flatten()).backward()
    assert m.loop_scale_raw.grad is not None and m.loop_scale_raw.grad.abs() > 0
    with torch.no_grad():
        m.loop_scale_raw.fill_(50.0)
    assert 0 < float(m.loop_scale().detach()) <= 1.0
    assert m.metrics()["loop/scale"] == pytest.approx(0.5)  # the value of the last forward
    m(ids())
    assert m.metrics()["loop/scale"] == pytest.approx(1.0)


def test_scheduled_loop_scale_is_linear_in_progress():
    m = build(loop_scale="scheduled", loop_scale_init=0.2, loop_scale_end=1.0)
    m.set_progress(0, 11)
    assert m.loop_scale() == pytest.approx(0.2)
    m.set_progress(5, 11)
    assert m.loop_scale() == pytest.approx(0.6)
    m.set_progress(10, 11)
    assert m.loop_scale() == pytest.approx(1.0)


def test_truncated_backprop_matches_a_no_grad_prefix():
    x, y = ids(), ids(seed=2)
    m = build(loops=4, backprop_loops=1).train()
    F.cross_entropy(m(x).flatten(0, 1), y.flatten()).backward()
    ref = build(loops=4).train()
    with torch.no_grad(), ref.loop_window(0, 3) as w:
        ref(x)
    with ref.loop_window(3, 4, state=w.state_out):
        F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
    for (name, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_random_loop_counts_are_seeded_by_step():
    m = build(loops=8, random_loops="uniform", min_loops=2).train()
    draws = []
    for step in range(20):
        m.set_progress(step, 100)
        draws.append(m._draw_loops())
    assert all(2 <= d <= 8 for d in draws) and len(set(draws)) > 2
    other = build(loops=8, random_loops="uniform", min_loops=2).train()
    other.set_progress(7, 100)
    assert other._draw_loops() == draws[7]
    m.cfg.random_loops = "poisson_lognormal"
    assert all(2 <= m._draw_loops() <= 8 for _ in range(3))


def test_carry_is_committed_on_success_and_kept_on_skip():
    m = build(carry=True, loops=2).train()
    x = ids()
    fresh = m(x)  # slot 0, no carry yet
    m.on_optimizer_step(skipped=False)
    carried = m.carry.state[0].clone()
    warm = m(x)  # starts from the carried state
    assert not torch.equal(warm, fresh)
    m.on_optimizer_step(skipped=True)  # rejected: carry unchanged
    assert torch.equal(m.carry.state[0], carried)
    m.eval()
    torch.testing.assert_close(m(x), fresh)  # evaluation never uses the carry


def test_carry_resets_on_document_end_and_age():
    m = build(carry=True, carry_reset_token=7, carry_max_steps=2).train()
    x = ids(b=3)
    x[1, 5] = 7  # row 1's document ends in this window
    x[0].masked_fill_(x[0] == 7, 8)
    x[2].masked_fill_(x[2] == 7, 8)
    m(x)
    m.on_optimizer_step(False)
    assert m.carry.ended[0].tolist() == [False, True, False]
    y = ids(b=3, seed=5).masked_fill(ids(b=3, seed=5) == 7, 8)
    m(y)
    m.on_optimizer_step(False)
    assert m.carry.age[0].tolist() == [2, 1, 2]  # row 1 restarted
    m(y)
    m.on_optimizer_step(False)
    assert m.carry.age[0].tolist() == [1, 2, 1]  # rows 0 and 2 hit carry_max_steps
    assert 0 < m.metrics()["carry/reset_fraction"] < 1


def test_carry_state_round_trip_is_bit_exact():
    m = build(carry=True).train()
    for seed in (1, 2):
        for slot_seed in (3, 4):  # two micro-batches per step: two slots
            m(ids(seed=seed * 10 + slot_seed))
        m.on_optimizer_step(False)
    state = {k: v.clone() for k, v in m.carry_state().items()}
    assert sorted(state) == ["age.0", "age.1", "ended.0", "ended.1", "state.0", "state.1"]
    other = build(carry=True).train()
    other.load_state_dict(m.state_dict())
    other.load_carry_state(state)
    x = ids(seed=9)
    assert torch.equal(m(x), other(x))
    for k, v in other.carry_state().items():
        assert torch.equal(v, state[k])


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("age.0"), "incomplete"),
    (lambda d: d.update({"bogus": torch.zeros(1)}), "unexpected"),
    (lambda d: d.update({"age.0": d["age.0"].float()}), "expected state"),
    (lambda d: d["state.0"].__setitem__((0, 0, 0), float("nan")), "non-finite"),
])
def test_bad_carry_payloads_are_rejected(mutate, match):
    m = build(carry=True).train()
    m(ids())
    m.on_optimizer_step(False)
    d = {k: v.clone() for k, v in m.carry_state().items()}
    mutate(d)
    before = m.carry_state()["state.0"].clone()
    with pytest.raises(CheckpointError, match=match):
        m.load_carry_state(d)
    assert torch.equal(m.carry_state()["state.0"], before)


def test_moe_inside_the_loop_counts_active_parameters_and_balances():
    c = cfg(loops=3)
    c.ffn = default_config("ffn", "moe", n_experts=4, top_k=1, hidden_dim=16)
    torch.manual_seed(0)
    m = c.build(vocab_size=V, seq_len=T).train()
    total, active = m.num_params(), m.num_params(active_only=True)
    per_block_inactive = 3 * (3 * 32 * 16)  # 3 of 4 experts idle per token
    assert total - active == 4 * per_block_inactive
    summary = m.param_summary()
    assert summary["total"] == total and summary["layers applied per token (H loops)"] == 8
    m(ids())
    moe = m.layers["1"].feed_forward
    assert moe.tokens_per_expert.sum() == 3 * 2 * T  # the recurrent block routes every loop
    m.on_global_step(False)
    assert moe.expert_bias.abs().sum() > 0 and "moe/max_load" in m.metrics()


def test_flops_count_loops_and_truncation():
    full, trunc = build(loops=8), build(loops=8, backprop_loops=2)
    assert full.flops_per_token(T) > trunc.flops_per_token(T) > build(loops=2).flops_per_token(T)


@pytest.mark.parametrize("tied", [False, True])
def test_meta_build_then_init_matches_direct_build(tied):
    opts = dict(injection="adapter", loop_scale="learned", loop_scale_init=0.8,
                tie_embeddings=tied)
    direct = build(seed=3, **opts)
    with torch.device("meta"):
        meta = cfg(**opts).build(vocab_size=V, seq_len=T)
    meta.to_empty(device="cpu")
    assert (meta.output.weight is meta.tok_embeddings.weight) == tied
    assert meta.num_params() == direct.num_params()
    torch.manual_seed(3)
    meta.init_weights()
    for (k, a), b in zip(direct.state_dict().items(), meta.state_dict().values(), strict=True):
        assert torch.equal(a, b), k

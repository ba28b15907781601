"""segmented_bptt: K = H equals the standard step; segments step, skip and stay K-bounded."""

from __future__ import annotations

import pytest
import torch

from kiln.components.base import default_config
from kiln.components.errors import RecipeError
from kiln.components.optimizers.common import ParamRule
from kiln.components.steps.common import GuardDecision
from tests.components.steps.trainer_stub import StubTrainer

V, T = 40, 12


def model_cfg(**values):
    c = default_config("model", "looped", dim=32, **values)
    c.attention.n_heads = 4
    return c


def build(seed=0, **values):
    torch.manual_seed(seed)
    return model_cfg(**values).build(vocab_size=V, seq_len=T).train()


def batches(n=2, step=0):
    g = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(n):
        x = torch.randint(0, V, (2, T + 1), generator=g)
        out.append({"input_ids": x[:, :-1], "labels": x[:, 1:]})
    return out


def step(kind, **values):
    return default_config("step", kind, **values).build()


@pytest.mark.parametrize("extra", [{}, {"carry": True, "loop_scale": "learned",
                                       "loop_scale_init": 0.9}])
def test_one_segment_equals_the_standard_step(extra):
    runs = []
    for kind, opts in (("standard", {}), ("segmented_bptt", {"segment_loops": 4})):
        model = build(loops=4, **extra)
        trainer = StubTrainer(model)
        losses = [trainer.run(step(kind, **opts), batches(step=s)).loss for s in range(3)]
        runs.append((losses, model.state_dict(), model.carry_state()))
    (la, sa, ca), (lb, sb, cb) = runs
    assert la == lb
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    if ca is not None:
        assert all(torch.equal(ca[k], cb[k]) for k in ca)


class CountingOptimizerSteps:
    def __init__(self, trainer):
        self.calls = {name: 0 for name in trainer.optimizers.optimizers}
        for name, opt in trainer.optimizers.optimizers.items():
            opt.register_step_post_hook(lambda *_, n=name: self.calls.__setitem__(
                n, self.calls[n] + 1))


def test_one_optimizer_step_per_segment_and_global_groups_on_the_last():
    model = build(loops=5, loop_scale="learned", loop_scale_init=0.9)
    tables = {
        "main": default_config("optimizer", "adamw", lr=1e-3, params=ParamRule(rest=True)),
        "lam": default_config("optimizer", "adamw", lr=1e-2, step_every="global",
                              params=ParamRule(include=["loop_scale_raw"])),
    }
    trainer = StubTrainer(model, optimizers=tables)
    counter = CountingOptimizerSteps(trainer)
    result = trainer.run(step("segmented_bptt", segment_loops=2), batches())
    assert counter.calls == {"main": 3, "lam": 1}  # segments [0,2) [2,4) [4,5)
    assert result.metrics["segments_done"] == 3.0 and not result.skipped
    assert result.loss == result.metrics["loss/segment2"]


class SkipSegment:
    """A guard that rejects one segment index."""

    def __init__(self, segment):
        self.segment, self.commits = segment, []

    def decide(self, stats, step, segment):
        return GuardDecision(skip=segment == self.segment, reason="test skip")

    def commit(self, decision, stats, step, segment):
        self.commits.append((step, segment, decision.skip))


def test_a_skipped_segment_ends_the_global_step():
    c = model_cfg(loops=6, carry=True)
    c.ffn = default_config("ffn", "moe", n_experts=4, top_k=1, hidden_dim=16)
    torch.manual_seed(0)
    model = c.build(vocab_size=V, seq_len=T).train()
    guard = SkipSegment(1)
    trainer = StubTrainer(model, guards={"skip": guard})
    counter = CountingOptimizerSteps(trainer)
    moe = model.layers["1"].feed_forward
    result = trainer.run(step("segmented_bptt", segment_loops=2), batches())
    assert result.skipped and result.reason == "test skip"
    assert result.metrics["segments_done"] == 2.0
    assert guard.commits == [(0, 0, False), (0, 1, True)]
    assert counter.calls == {"main": 1}
    # As the reference: a global step with a skipped segment leaves the MoE bias alone (segment
    # 0's loads are dropped too, not applied before the skip).
    assert moe.expert_bias.abs().sum() == 0 and moe.tokens_per_expert.sum() == 0
    assert model.carry.state == {}  # the final state was never reached: no carry


def test_moe_bias_moves_once_per_global_step_from_every_segments_loads():
    """Issue 10 item 3: the bias moved once per segment (ceil(H/K) times a step)."""
    c = model_cfg(loops=4, n_prelude=0, n_coda=0, n_recurrent=1)
    c.ffn = default_config("ffn", "moe", n_experts=4, top_k=1, hidden_dim=16)
    torch.manual_seed(0)
    model = c.build(vocab_size=V, seq_len=T).train()
    moe = model.layers["0"].feed_forward
    applied = []
    real = moe.apply_load
    moe.apply_load = lambda load: (applied.append(load.clone()), real(load))
    trainer = StubTrainer(model)
    trainer.run(step("segmented_bptt", segment_loops=1), batches())  # 4 segments, 2 micro
    assert len(applied) == 1  # one move per global step
    assert applied[0].sum() == 4 * 2 * 2 * T  # 4 loops x 2 micro-batches x (2 x T) tokens
    expected = 1e-3 * torch.sign(applied[0].mean() - applied[0])
    torch.testing.assert_close(moe.expert_bias, expected - expected.mean())


def test_non_looped_model_is_refused():
    c = default_config("model", "transformer", dim=32, n_layers=1)
    c.attention.n_heads = 4
    trainer = StubTrainer(c.build(vocab_size=V, seq_len=T))
    with pytest.raises(RecipeError, match="looped model"):
        trainer.run(step("segmented_bptt", segment_loops=2), batches())


def test_carry_persists_across_segmented_steps():
    runs = {}
    for carry in (False, True):
        model = build(loops=4, carry=carry)
        trainer = StubTrainer(model)
        runs[carry] = [trainer.run(step("segmented_bptt", segment_loops=2),
                                   batches(step=s)).loss for s in range(3)]
    assert runs[True][0] == runs[False][0]  # no carry yet at the first step
    assert runs[True][1] != runs[False][1]  # then each slot starts from its carried state
    assert model.carry.age[0].tolist() == [3, 3] and model.carry.age[1].tolist() == [3, 3]
    assert model.metrics()["carry/reset_fraction"] == 0.0

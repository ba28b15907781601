"""spike_guard: decisions on scripted loss sequences, state round trip and strict validation."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from kiln.components import distributed
from kiln.components.base import default_config
from kiln.components.errors import CheckpointError
from tests import forked


def make(tmp_path=None, **values):
    return default_config("guard", "spike_guard", **values).build(run_dir=tmp_path)


def feed(guard, losses, *, segment=0, start=0, grad_norm=1.0):
    """One loss per step; returns the list of (skip, abort, reason) decisions."""
    out = []
    for i, loss in enumerate(losses):
        stats = {"loss": loss, "grad_norm": grad_norm}
        d = guard.decide(stats, start + i, segment)
        guard.commit(d, stats, start + i, segment)
        out.append(d)
    return out


# Thresholds isolated one at a time: the others are switched off (0) or out of reach.
@pytest.mark.parametrize("cfg, ok, bad", [
    (dict(hard=1.0, ratio=0, rel=0, delta_floor=100.0), 3.9, 4.0),  # hard: d >= 1.0
    (dict(hard=0, ratio=0.1, rel=0, delta_floor=100.0), 3.29, 3.31),  # ratio: >= 3 * 1.1
    (dict(hard=0, ratio=0, rel=0.05, delta_floor=0.1), 3.14, 3.16),  # adaptive: 0.15 > 0.1
    (dict(hard=0, ratio=0, rel=0.01, delta_floor=0.5), 3.49, 3.51),  # floor 0.5 > 0.03
])
def test_each_threshold(cfg, ok, bad):
    guard = make(ema=0.0, **cfg)
    assert not any(d.skip for d in feed(guard, [3.0, ok]))
    guard = make(ema=0.0, **cfg)
    d = feed(guard, [3.0, bad])[1]
    assert d.skip and not d.abort and d.reason.split(":")[0] in ("hard", "ratio", "jump")


def test_ema_baseline_and_spikes_do_not_enter_it():
    guard = make(ema=0.5, hard=0, ratio=0, rel=0, delta_floor=0.5)
    feed(guard, [4.0, 3.0])  # EMA: 4 -> 3.5
    assert guard.baseline[0] == pytest.approx(3.5)
    d = feed(guard, [4.1], start=2)[0]  # 4.1 - 3.5 = 0.6 >= 0.5
    assert d.skip and guard.baseline[0] == pytest.approx(3.5)
    assert guard.counters["spikes_total"] == 1 and guard.counters["skips_total"] == 1


def test_warmup_checks_only_nonfinite():
    guard = make(warmup_steps=3, ema=0.0)
    decisions = feed(guard, [5.0, 9.0, 20.0, 20.5, 30.0])
    assert [d.skip for d in decisions] == [False, False, False, False, True]
    guard = make(warmup_steps=10)
    assert feed(guard, [float("nan")])[0].skip  # non-finite still skips in warmup


def test_per_segment_cold_start():
    guard = make(ema=0.0)
    # Segment 0 sits at 5.0, segment 1 at 3.0; each segment has its own baseline.
    for step in range(3):
        for seg, loss in ((0, 5.0), (1, 3.0)):
            stats = {"loss": loss}
            d = guard.decide(stats, step, seg)
            assert not d.skip
            guard.commit(d, stats, step, seg)
    # A first observation of segment 2 is accepted whatever it is (cold start).
    assert not guard.decide({"loss": 50.0}, 3, 2).skip
    # Segment 1 at 5.0 is a spike against its own baseline 3.0 (not against segment 0's).
    assert guard.decide({"loss": 5.0}, 3, 1).skip
    assert not guard.decide({"loss": 5.0}, 3, 0).skip


@pytest.mark.parametrize("key", ["loss", "grad_norm"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite(key, value):
    guard = make()
    stats = {"loss": 3.0, "grad_norm": 1.0, key: value}
    d = guard.decide(stats, 0, 0)
    assert d.skip and d.reason.startswith(f"nonfinite_{key}")
    guard.commit(d, stats, 0, 0)
    assert guard.counters["nonfinite_total"] == 1 and guard.baseline == {}


def test_nan_gradients_from_a_real_backward():
    """A NaN injected into one gradient reaches the guard through clip_grad_norm_'s norm."""
    lin = torch.nn.Linear(4, 4)
    lin(torch.randn(2, 4)).sum().backward()
    lin.weight.grad[0, 0] = float("nan")
    norm = torch.nn.utils.clip_grad_norm_(lin.parameters(), 1.0)
    d = make().decide({"loss": 1.0, "grad_norm": float(norm)}, 0, 0)
    assert d.skip and d.reason.startswith("nonfinite_grad_norm")


def test_abort_on_spike_writes_alarm_and_event(tmp_path):
    guard = make(tmp_path, abort_on_spike=True, ema=0.0)
    decisions = feed(guard, [3.0, 3.0, 8.0])
    assert decisions[2].skip and decisions[2].abort and guard.aborted
    alarm = json.loads((tmp_path / "SPIKE_ABORT.json").read_text())
    assert alarm["step"] == 2 and alarm["abort"] is True and alarm["loss"] == 8.0
    events = [json.loads(x) for x in (tmp_path / "spike_events.jsonl").read_text().splitlines()]
    assert len(events) == 1 and events[0]["reason"].startswith("hard")
    assert guard.state_dict()["aborted"] is True


def test_consecutive_abort_counts_steps_not_segments(tmp_path):
    guard = make(tmp_path, abort_consecutive=3)
    nan = {"loss": float("nan")}
    ok = {"loss": 3.0}

    def run(step, seg, stats):
        d = guard.decide(stats, step, seg)
        guard.commit(d, stats, step, seg)
        return d

    assert not run(0, 0, ok).skip
    assert run(1, 0, nan).skip  # step 1 skipped at its first segment
    assert not run(2, 0, ok).skip
    d = run(2, 1, nan)  # step 2 skipped at its second segment: 2 consecutive
    assert d.skip and not d.abort
    assert guard.counters["consecutive_skipped_steps"] == 2
    assert not run(3, 0, ok).skip and not run(3, 1, ok).skip  # a clean step resets the run
    assert not run(4, 0, nan).abort
    assert guard.counters["consecutive_skipped_steps"] == 1
    assert not run(5, 0, nan).abort
    d = run(6, 0, nan)
    assert d.abort and "3 consecutive" in d.reason and guard.aborted
    assert (tmp_path / "SPIKE_ABORT.json").exists()
    assert len((tmp_path / "spike_events.jsonl").read_text().splitlines()) == 5


def test_state_round_trip_is_exact_and_json():
    guard = make(ema=0.9)
    feed(guard, [3.0, 2.9, float("nan"), 2.8])
    state = json.loads(json.dumps(guard.state_dict()))
    other = make()
    other.load_state_dict(state)
    assert other.state_dict() == guard.state_dict()
    # Same future decisions.
    for g in (guard, other):
        assert g.decide({"loss": 3.2}, 4, 0).skip
        assert not g.decide({"loss": 2.85}, 4, 0).skip


@pytest.mark.parametrize("mutate, match", [
    (lambda s: s.pop("aborted"), "fields"),
    (lambda s: s.update(extra=1), "fields"),
    (lambda s: s.update(version=2), "version"),
    (lambda s: s.update(skips_total=-1), "skips_total"),
    (lambda s: s.update(skips_total=1.0), "skips_total"),
    (lambda s: s.update(skips_total=True), "skips_total"),
    (lambda s: s.update(aborted=1), "aborted"),
    (lambda s: s.update(baseline={"0": math.nan}), "finite"),
    (lambda s: s.update(baseline={"0": "3.0"}), "finite"),
    (lambda s: s.update(baseline={"-1": 3.0}), "segment"),
    (lambda s: s.update(baseline={"01": 3.0}), "segment"),
    (lambda s: s.update(baseline=[3.0]), "baseline"),
    (lambda s: s.update(current_step=-2), "current_step"),
    (lambda s: s.update(last_reason=3), "last_reason"),
])
def test_load_rejects_bad_states_without_changing_anything(mutate, match):
    guard = make()
    feed(guard, [3.0, 3.1])
    before = guard.state_dict()
    bad = guard.state_dict()
    mutate(bad)
    with pytest.raises(CheckpointError, match=match):
        guard.load_state_dict(bad)
    assert guard.state_dict() == before


def test_metrics_are_counters_and_baselines():
    guard = make()
    feed(guard, [3.0, float("inf")])
    m = guard.metrics()
    assert m["guard/skips_total"] == 1.0 and m["guard/nonfinite_total"] == 1.0
    assert m["guard/baseline_seg0"] == 3.0


# ------------------------------------------------------------------ two ranks, one NaN
def _agreement_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from tests.components.steps.trainer_stub import StubTrainer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        c = default_config("model", "looped", dim=32, loops=4)
        c.attention.n_heads = 4
        c.ffn = default_config("ffn", "moe", n_experts=4, top_k=1, hidden_dim=16)
        torch.manual_seed(0)  # same initial weights on both ranks
        model = c.build(vocab_size=40, seq_len=8).train()
        guard = make(out_dir if rank == 0 else None, ema=0.0)
        trainer = StubTrainer(model, guards={"spike": guard}, rank=rank, world_size=2)
        fn = default_config("step", "segmented_bptt", segment_loops=2).build()
        gen = torch.Generator().manual_seed(10 + rank)  # each rank its own data
        skipped, handle = [], None
        for step in range(4):
            if step == 2 and rank == 1:  # only rank 1 sees a NaN gradient, in segment 0
                p = model.layers["1"].attention.wq.weight
                handle = p.register_hook(lambda g: g * float("nan"))
            x = torch.randint(0, 40, (2, 9), generator=gen)
            result = trainer.run(fn, [{"input_ids": x[:, :-1], "labels": x[:, 1:]}])
            if handle is not None:
                handle.remove()
                handle = None
            skipped.append((result.skipped, result.reason.split("=")[0]))
        flat = torch.cat([t.detach().flatten().float() for t in model.state_dict().values()])
        torch.save({"skipped": skipped, "params": flat, "guard": guard.state_dict()},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        distributed.shutdown(together=sys.exc_info()[0] is None)


@pytest.mark.slow
def test_two_ranks_agree_when_only_one_sees_a_nan(tmp_path):
    from tests.parallelisms.tiny import free_port

    forked.spawn(_agreement_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    expected = [(False, ""), (False, ""), (True, "nonfinite_grad_norm"), (False, "")]
    assert r0["skipped"] == r1["skipped"] == expected
    assert torch.equal(r0["params"], r1["params"])  # weights and MoE biases identical
    assert torch.isfinite(r0["params"]).all()
    assert r0["guard"] == r1["guard"] and r0["guard"]["nonfinite_total"] == 1
    events = (tmp_path / "spike_events.jsonl").read_text().splitlines()  # rank 0 writes
    assert len(events) == 1 and json.loads(events[0])["step"] == 2

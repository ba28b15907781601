"""Tensor and expert parallelism against one process (issue 14 item 8): gloo CPU processes train
tiny models (cases in ``scale_out``) and must give the single-process losses and gradient norms
to rtol 1e-5. One spawn per world size runs all its cases, to keep the slow set small."""

from __future__ import annotations

import json

import pytest

from tests import forked
from tests.parallelisms import scale_out
from tests.parallelisms.tiny import free_port

RTOL = 1e-5

TWO = {
    "dense_tp2": {"model": "dense", "parallelism": {"tp": 2}},
    "differential_tp2": {"model": "differential", "parallelism": {"tp": 2}, "accum": 2},
    "looped_moe_tp2": {"model": "looped_moe", "parallelism": {"tp": 2}},
    "muon_tp2": {"model": "differential", "parallelism": {"tp": 2}, "check": "muon_step"},
    "looped_moe_ep2": {"model": "looped_moe", "parallelism": {"ep": 2}, "accum": 2},
    "looped_moe_ep2_replicated": {"model": "looped_moe", "parallelism": {"ep": 2, "fsdp": "off"}},
    "muon_ep2": {"model": "looped_moe", "parallelism": {"ep": 2}, "check": "muon_step"},
    # Muon trained for several steps: Newton-Schulz amplifies the rounding of gradient sums
    # taken in another order (measured in bf16: 2e-5 on losses, 2e-4 on norms by step 4; on CPU
    # it now runs in fp32); the step itself is exact (the muon_step cases above)
    "muon_train_tp2": {"model": "differential", "parallelism": {"tp": 2}, "optimizer": "muon",
                       "rtol": 1e-3},
    "muon_train_ep2": {"model": "looped_moe", "parallelism": {"ep": 2}, "optimizer": "muon",
                       "rtol": 1e-3},
    # DTensor blocks traced forward and backward; inductor's kernels are test_compile's subject
    # (and context parallel's, whose compiled blocks hold a collective)
    "compile_tp2": {"model": "dense", "parallelism": {"tp": 2, "compile": True,
                                                      "compile_backend": "aot_eager"}},
}
FOUR = {
    "dense_tp2_dp2": {"model": "dense", "parallelism": {"tp": 2, "dp_shard": 2}},
    "looped_moe_ep2_dp2": {"model": "looped_moe", "parallelism": {"ep": 2}},
    "looped_moe_ep2_tp2_hsdp": {"model": "looped_moe",
                                "parallelism": {"ep": 2, "tp": 2, "dp_replicate": 2}},
}


def _spawn(cases: dict, world_size: int, tmp_path) -> list[dict]:
    forked.spawn(scale_out.worker, nprocs=world_size,
                 args=(world_size, free_port(), cases, str(tmp_path)))
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


def _check(ranks: list[dict], cases: dict) -> None:
    world_size = len(ranks)
    for name, case in cases.items():
        if case.get("check") == "muon_step":
            for r, res in enumerate(ranks):
                assert res[name] < 1e-6, f"{name} rank {r}: Muon step differs by {res[name]}"
            continue
        ref = scale_out.reference(case)
        rtol = case.get("rtol", RTOL)
        for r, res in enumerate(ranks):
            got = res[name]
            assert got["loss"] == pytest.approx(ref["loss"], rel=rtol), (name, r, got, ref)
            assert got["norm"] == pytest.approx(ref["norm"], rel=rtol), (name, r, got, ref)
        # the layout planner (kiln validate --world-size) predicts what rank 0 really holds
        assert ranks[0][name]["param_bytes"] == scale_out.planned_param_bytes(case, world_size)
        if case["parallelism"].get("compile"):
            assert "compile" in ranks[0][name]["summary"], ranks[0][name]["summary"]
        assert ref["loss"][-1] < ref["loss"][0], f"{name}: the reference does not learn"
        if "ep" in case["parallelism"]:  # expert loads: every rank reports the global ones
            assert ranks[0][name]["max_load"] == pytest.approx(ref["max_load"], rel=RTOL)


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    _check(_spawn(TWO, 2, tmp_path), TWO)


@pytest.mark.slow
def test_four_processes_match_one(tmp_path):
    _check(_spawn(FOUR, 4, tmp_path), FOUR)

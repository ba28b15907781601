"""The runtime payload {version, step, carry, guard_fields}: strict validation on load."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.checkpointing import payload
from kiln.components.errors import CheckpointError


def good() -> dict:
    return {"version": 1, "step": 5, "carry": {"z": torch.zeros(2, 3)},
            "guard_fields": {"spike": {"ema": 1.5, "skips": 0, "aborted": False,
                                       "baseline": {"0": 2.0}, "reason": None}}}


def check(p, step=5, guards=("spike",)):
    return payload.validate(p, expected_step=step, guard_names=set(guards), where="test")


def test_a_good_payload_passes_and_round_trips_through_split_join():
    p = good()
    assert check(p) is p
    tensors, header = payload.split(p)
    assert set(tensors) == {"carry.z"} and header["carry"] == ["z"]
    back = payload.join(tensors, header, "test")
    assert torch.equal(back["carry"]["z"], p["carry"]["z"])
    assert check(back)["guard_fields"] == p["guard_fields"]


def test_no_carry_is_none():
    p = {**good(), "carry": None}
    tensors, header = payload.split(p)
    assert tensors == {} and header["carry"] is None
    assert payload.join({}, header, "t")["carry"] is None


INF = float("inf")
BAD = {
    "missing field": lambda p: p.pop("carry"),
    "extra field": lambda p: p.__setitem__("extra", 1),
    "unknown version": lambda p: p.__setitem__("version", 2),
    "version as bool": lambda p: p.__setitem__("version", True),
    "step as float": lambda p: p.__setitem__("step", 5.0),
    "step mismatch": lambda p: p.__setitem__("step", 4),
    "negative step": lambda p: p.__setitem__("step", -1),
    "carry not tensors": lambda p: p.__setitem__("carry", {"z": [1, 2]}),
    "carry not finite": lambda p: p["carry"].__setitem__("z", torch.tensor([float("nan")])),
    "guard state not a dict": lambda p: p["guard_fields"].__setitem__("spike", 3),
    "non-finite guard number": lambda p: p["guard_fields"]["spike"].__setitem__("ema", INF),
    "nested non-finite": lambda p: p["guard_fields"]["spike"]["baseline"].__setitem__("1", INF),
    "non-JSON guard value": lambda p: p["guard_fields"]["spike"].__setitem__("x", (1, 2)),
    "tensor in guard state": lambda p: p["guard_fields"]["spike"].__setitem__("x", torch.ones(1)),
    "guard missing": lambda p: p.__setitem__("guard_fields", {}),
    "guard added": lambda p: p["guard_fields"].__setitem__("other", {}),
}


@pytest.mark.parametrize("name", list(BAD))
def test_invalid_payloads_are_refused(name):
    p = copy.deepcopy(good())
    BAD[name](p)
    with pytest.raises(CheckpointError, match="invalid runtime payload"):
        check(p)


def test_not_a_dict():
    with pytest.raises(CheckpointError):
        check([1, 2])


def test_aborted_guard_state_is_detected():
    p = good()
    assert payload.aborted_guards(p) == []
    p["guard_fields"]["spike"]["aborted"] = True
    assert payload.aborted_guards(check(p)) == ["spike"]


def test_join_rejects_carry_tensors_that_disagree_with_the_header():
    tensors, header = payload.split(good())
    with pytest.raises(CheckpointError, match="do not match"):
        payload.join({}, header, "t")
    with pytest.raises(CheckpointError, match="says none"):
        payload.join(tensors, {**header, "carry": None}, "t")


def test_capture_reads_model_carry_and_guards():
    class M(torch.nn.Module):
        def carry_state(self):
            return {"h": torch.ones(2)}

    class G:
        def state_dict(self):
            return {"n": 1}

    p = payload.capture(3, M(), {"g": G()})
    assert p["step"] == 3 and p["guard_fields"] == {"g": {"n": 1}}
    assert torch.equal(p["carry"]["h"], torch.ones(2))

"""The looped model's carry on its own: when rows reset, commit/skip, and the state round trip."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kiln.components.errors import CheckpointError
from kiln.components.models.looped_carry import Carry

B, T, DIM, EOS = 3, 4, 2, 9


def make(max_steps: int = 0, reset_token: int = -1) -> Carry:
    return Carry(SimpleNamespace(carry_max_steps=max_steps, carry_reset_token=reset_token))


def step(carry: Carry, fresh: torch.Tensor, final: torch.Tensor, ids: torch.Tensor,
         skipped: bool = False, slot: int = 0) -> torch.Tensor:
    s0 = carry.initial(slot, fresh)
    carry.stage(slot, final, ids)
    carry.commit(skipped)
    return s0


def ids_without_eos() -> torch.Tensor:
    return torch.zeros(B, T, dtype=torch.long)


def test_first_use_is_fresh_then_carried():
    c = make()
    fresh, final = torch.zeros(B, T, DIM), torch.ones(B, T, DIM)
    assert torch.equal(step(c, fresh, final, ids_without_eos()), fresh)
    assert c.last_reset_fraction == 1.0
    assert torch.equal(step(c, fresh, final * 2, ids_without_eos()), final)
    assert c.last_reset_fraction == 0.0
    assert c.age[0].tolist() == [2, 2, 2]


def test_changed_batch_shape_resets():
    c = make()
    step(c, torch.zeros(B, T, DIM), torch.ones(B, T, DIM), ids_without_eos())
    fresh = torch.full((B, T + 1, DIM), 5.0)
    assert torch.equal(c.initial(0, fresh), fresh)


def test_max_steps_resets_stale_rows():
    c = make(max_steps=2)
    fresh = torch.zeros(B, T, DIM)
    for k in range(1, 3):
        step(c, fresh, torch.full((B, T, DIM), float(k)), ids_without_eos())
    assert c.age[0].tolist() == [2, 2, 2]
    assert torch.equal(step(c, fresh, torch.full((B, T, DIM), 3.0), ids_without_eos()), fresh)
    assert c.age[0].tolist() == [1, 1, 1]  # restarted counting after the reset


def test_reset_token_resets_only_rows_whose_document_ended():
    c = make(reset_token=EOS)
    fresh, final = torch.zeros(B, T, DIM), torch.ones(B, T, DIM)
    ids = ids_without_eos()
    ids[1, 2] = EOS
    step(c, fresh, final, ids)
    assert c.ended[0].tolist() == [False, True, False]
    s0 = step(c, fresh, final, ids_without_eos())
    assert torch.equal(s0[0], final[0]) and torch.equal(s0[2], final[2])
    assert torch.equal(s0[1], fresh[1])
    assert c.last_reset_fraction == pytest.approx(1 / 3)
    assert c.age[0].tolist() == [2, 1, 2]


def test_skipped_step_keeps_the_previous_carry():
    c = make()
    fresh = torch.zeros(B, T, DIM)
    step(c, fresh, torch.ones(B, T, DIM), ids_without_eos())
    step(c, fresh, torch.full((B, T, DIM), float("nan")), ids_without_eos(), skipped=True)
    assert torch.equal(c.state[0], torch.ones(B, T, DIM))
    assert c.age[0].tolist() == [1, 1, 1]


def test_slots_are_independent():
    c = make()
    fresh = torch.zeros(B, T, DIM)
    c.initial(0, fresh)
    c.stage(0, torch.ones(B, T, DIM), ids_without_eos())
    c.initial(1, fresh)
    c.stage(1, torch.full((B, T, DIM), 2.0), ids_without_eos())
    c.commit(False)
    assert torch.equal(c.initial(1, fresh), torch.full((B, T, DIM), 2.0))
    assert torch.equal(c.initial(0, fresh), torch.ones(B, T, DIM))


def test_state_dict_round_trip_and_validation():
    c = make(reset_token=EOS)
    ids = ids_without_eos()
    ids[0, 0] = EOS
    step(c, torch.zeros(B, T, DIM), torch.randn(B, T, DIM), ids)
    sd = c.state_dict()
    assert set(sd) == {"state.0", "age.0", "ended.0"}
    d = make(reset_token=EOS)
    d.load_state_dict(sd)
    for key in ("state", "age", "ended"):
        assert torch.equal(getattr(d, key)[0], getattr(c, key)[0])

    bad = [{"weird.0": sd["state.0"]},
           {"state.0": sd["state.0"], "age.0": sd["age.0"]},  # incomplete slot
           {**sd, "age.0": sd["age.0"].float()},
           {**sd, "state.0": torch.full((B, T, DIM), float("inf"))}]
    for entry in bad:
        with pytest.raises(CheckpointError):
            d.load_state_dict(entry)
        assert torch.equal(d.state[0], c.state[0])  # nothing changed on a failed load

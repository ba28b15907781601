"""Per-rank RNG state: exact round trip of every generator, strict validation."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kiln.checkpointing import rng
from kiln.components.errors import CheckpointError


def draws() -> tuple:
    return (torch.rand(3).tolist(), random.random(), random.gauss(0, 1), np.random.rand(2).tolist(),
            np.random.randn())


def test_round_trip_restores_every_generator():
    torch.manual_seed(1)
    random.seed(2)
    np.random.seed(3)
    random.gauss(0, 1)  # leave a cached gaussian in python's state
    np.random.randn(3)  # and (maybe) one in numpy's
    tensors, info = rng.capture()
    expected = draws()
    draws()  # move on
    rng.restore(tensors, info)
    assert draws() == expected


def test_state_survives_a_safetensors_file(tmp_path):
    from kiln.checkpointing.storage import load_rank_file, save_rank_file

    tensors, info = rng.capture()
    expected = draws()
    save_rank_file(tmp_path / "r.safetensors", tensors, {"rng": info})
    loaded, header = load_rank_file(tmp_path / "r.safetensors")
    rng.restore(loaded, header["rng"])
    assert draws() == expected


@pytest.mark.parametrize("edit", [
    lambda t, i: t.pop("rng.numpy"),
    lambda t, i: t.__setitem__("rng.python", t["rng.python"][:10]),
    lambda t, i: t.__setitem__("rng.numpy", t["rng.numpy"] - 2**40),
    lambda t, i: i["numpy"].__setitem__("pos", 9999),
    lambda t, i: i["numpy"].__setitem__("cached_gaussian", float("nan")),
    lambda t, i: i.__setitem__("extra", 1),
    lambda t, i: i.__setitem__("cuda_devices", 2),
])
def test_invalid_state_is_refused_without_touching_the_generators(edit):
    tensors, info = rng.capture()
    edit(tensors, info)
    torch.manual_seed(7)
    before = torch.get_rng_state()
    with pytest.raises(CheckpointError, match="invalid RNG state"):
        rng.restore(tensors, info)
    assert torch.equal(torch.get_rng_state(), before)


def test_seed_step_derives_every_generator_from_seed_and_step_alone():
    rng.seed_step(0, 7)
    first = draws()
    torch.rand(100)  # whatever came before (another layout, another history) does not matter
    random.random()
    rng.seed_step(0, 7)
    assert draws() == first
    rng.seed_step(0, 8)
    assert draws() != first
    rng.seed_step(1, 7)
    assert draws() != first

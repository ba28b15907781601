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
    lambda t, i: i.__setitem__("accelerator", {"type": "cuda", "count": 2}),
    lambda t, i: i.__setitem__("accelerator", {"type": "tpu", "count": 0}),
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


def test_a_checkpoint_from_before_other_accelerators_still_loads():
    """Older snapshots say ``cuda_devices: N``; a CPU one (N = 0) restores exactly."""
    tensors, info = rng.capture()
    assert info["accelerator"] == {"type": "", "count": 0}  # CPU-only here
    legacy = {"python": info["python"], "numpy": info["numpy"], "cuda_devices": 0}
    expected = draws()
    rng.restore(tensors, legacy)
    assert draws() == expected
    with pytest.raises(CheckpointError, match="invalid RNG state"):
        rng.restore(tensors, {**legacy, "cuda_devices": 1})  # says 1 device, holds none


def test_accelerator_generators_are_saved_and_restored_by_device_type(monkeypatch):
    """A faked NPU with two devices: its states travel as rng.npu.0/1 and come back."""
    from kiln.components import devices

    held = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]
    monkeypatch.setattr(devices, "rng_device_type", lambda: "npu")
    monkeypatch.setattr(devices, "accelerator_type", lambda: "npu")
    monkeypatch.setattr(devices, "rng_states", lambda kind: [t.clone() for t in held])
    monkeypatch.setattr(devices, "device_count", lambda kind: 2)
    restored = {}
    monkeypatch.setattr(devices, "set_rng_states", lambda kind, states: restored.update(
        {kind: [t.tolist() for t in states]}))
    tensors, info = rng.capture()
    assert info["accelerator"] == {"type": "npu", "count": 2} and "rng.npu.1" in tensors
    rng.restore(tensors, info)
    assert restored == {"npu": [[1, 2], [3, 4]]}
    monkeypatch.setattr(devices, "device_count", lambda kind: 1)
    with pytest.raises(CheckpointError, match="saved for 2 npu devices per process"):
        rng.restore(tensors, info)

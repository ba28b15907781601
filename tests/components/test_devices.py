"""The device layer: ``training.device`` selection, the backend per device type, pinned memory
and memory statistics, with the accelerator faked (CPU is the tested path here)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kiln.components import devices
from kiln.components.errors import RecipeError


@pytest.fixture
def fake_accelerator(monkeypatch):
    """fake_accelerator("xpu"): torch reports an available xpu accelerator."""

    def install(kind: str | None) -> None:
        acc = torch.device(kind) if kind in ("cuda", "xpu", "mps") else None
        monkeypatch.setattr(torch.accelerator, "current_accelerator",
                            lambda check_available=False: acc)
        monkeypatch.setattr(devices, "is_available", lambda k: k in ("cpu", kind))

    return install


def test_auto_takes_the_accelerator_present_else_the_cpu(fake_accelerator, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    fake_accelerator(None)
    assert devices.pick_device("auto") == torch.device("cpu")
    for kind in ("cuda", "xpu"):
        fake_accelerator(kind)
        assert devices.pick_device("auto") == torch.device(kind, 3)  # index = LOCAL_RANK
    fake_accelerator("mps")
    assert devices.pick_device("auto") == torch.device("mps")  # one device, no index
    assert devices.pick_device("cpu") == torch.device("cpu")


def test_auto_imports_torch_npu_first_when_it_is_installed(monkeypatch):
    """NPUs only become visible once torch_npu is imported: auto must import it."""
    imported = []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: object() if name == "torch_npu" else real_find_spec(name))
    monkeypatch.setattr(devices, "vendor_module", lambda kind: imported.append(kind))
    monkeypatch.setattr(torch.accelerator, "current_accelerator",
                        lambda check_available=False: None)
    assert devices.accelerator_type() is None
    assert imported == ["npu"]


@pytest.mark.parametrize("kind, package", [
    ("npu", "pip install torch-npu"), ("xpu", "whl/xpu"), ("cuda", "CUDA build of PyTorch"),
    ("mps", "Apple silicon"),
])
def test_a_device_that_is_not_there_names_what_to_install(kind, package):
    if devices.is_available(kind):
        pytest.skip(f"this machine has a {kind} device")
    with pytest.raises(RecipeError) as err:
        devices.pick_device(kind)
    assert f'training.device = "{kind}"' in str(err.value) and package in str(err.value)
    with pytest.raises(RecipeError) as err:  # a command's flag is named as the user typed it
        devices.pick_device(kind, key="--device")
    assert f"--device {kind} but" in str(err.value) and "or use --device auto" in str(err.value)


def test_npu_without_torch_npu_is_unavailable_not_a_crash(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name: None if name == "torch_npu" else real_find_spec(name))
    if not hasattr(torch, "npu"):
        assert devices.vendor_module("npu") is None and not devices.is_available("npu")


def test_mps_cannot_be_shared_by_several_processes(fake_accelerator):
    fake_accelerator("mps")
    with pytest.raises(RecipeError, match="2 processes cannot share it"):
        devices.pick_device("auto", world_size=2)


def test_unknown_device_is_refused():
    with pytest.raises(RecipeError, match="use one of auto, cpu, cuda, npu, xpu, mps"):
        devices.pick_device("tpu")


def test_backend_per_device_type():
    assert [devices.backend_for(k) for k in ("cpu", "cuda", "npu", "xpu", "mps")] == [
        "gloo", "nccl", "hccl", "xccl", "gloo"]
    for backend, kind in (("gloo", "cpu"), ("nccl", "cuda"), ("hccl", "npu"), ("xccl", "xpu"),
                          ("cpu:gloo,cuda:nccl", "cuda"), ("cpu:gloo,npu:hccl", "npu")):
        assert devices.device_type_of_backend(backend) == kind, backend


def test_init_picks_the_backend_of_the_device_type(monkeypatch):
    """distributed.init: the backend follows the device; the timeout and the flight recorder
    size reach torch.distributed."""
    import torch.distributed as dist

    from kiln.components import distributed

    seen = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    # setenv first: delenv of an unset name records nothing to undo, and the later delenv's
    # undo would then leave "500" in the environment of every test after this one
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "unset")
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(kw))
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout",
                        lambda timeout, group=None: seen.update(collectives=timeout))
    monkeypatch.setattr(devices, "pick_device", lambda choice, world_size: torch.device("xpu", 0))
    monkeypatch.setattr(devices, "set_current", lambda device: None)
    world = distributed.init("auto", timeout_s=90, flight_recorder=500)
    assert seen["backend"] == "xccl" and seen["timeout"].total_seconds() == 600  # the join
    assert seen["collectives"].total_seconds() == 90
    assert seen["device_id"] == torch.device("xpu", 0) and world.device.type == "xpu"
    import os

    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "500"
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    distributed.init("auto", flight_recorder=0)  # off: torch would keep 2000 when unset
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "0"
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "7")  # the environment's own choice wins
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    distributed.init("auto", flight_recorder=500)
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ


def test_pinned_memory_only_where_the_accelerator_copies_from_it(monkeypatch):
    for kind, want in ((None, False), ("mps", False), ("cuda", True), ("npu", True),
                       ("xpu", True)):
        monkeypatch.setattr(devices, "accelerator_type", lambda k=kind: k)
        assert devices.pin_memory_supported() is want, kind


def test_peak_memory_per_device_type(monkeypatch):
    from kiln.recipes.probes.process_stats import peak_memory_bytes, peak_rss_bytes

    asked = []
    monkeypatch.setattr(torch.accelerator, "max_memory_allocated",
                        lambda device: asked.append(device) or 1234)
    assert peak_memory_bytes(torch.device("xpu", 1)) == 1234 and asked == [torch.device("xpu", 1)]
    assert peak_memory_bytes(torch.device("cpu")) >= peak_rss_bytes() // 2 > 0


def test_the_commands_offer_the_same_devices_as_the_recipe():
    from kiln.recipes.commands.models import eval as eval_cmd
    from kiln.recipes.commands.models import generate
    from kiln.recipes.config.schema import TrainingConfig

    field = TrainingConfig.model_fields["device"].annotation
    assert generate.DEVICES == eval_cmd.DEVICES == devices.DEVICES == field.__args__

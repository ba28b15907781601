"""The device layer: which device a process trains on, and what differs per device type.

``training.device`` is ``auto`` or one of ``cpu``, ``cuda``, ``npu`` (Ascend, through the
``torch_npu`` adapter), ``xpu`` (Intel GPUs) or ``mps`` (Apple silicon). ``auto`` takes the
accelerator ``torch.accelerator`` reports (importing ``torch_npu`` first when it is installed,
since NPUs only register through it), else the CPU. Per device type this module knows the
distributed backend (``BACKENDS``), whether pinned host memory helps (``PIN_MEMORY``), the
per-device RNG states and peak-memory statistics. A device type whose vendor package is missing
gives one error naming what to install.

A leaf module: it imports only ``kiln.components.errors`` (``distributed`` builds on it).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

from kiln.components.errors import RecipeError

DEVICES = ("auto", "cpu", "cuda", "npu", "xpu", "mps")
# The collective library per device type; gloo moves CPU tensors (kiln's helpers stage there).
BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl", "xpu": "xccl", "mps": "gloo"}
# Device types whose host-to-device copies gain from page-locked buffers (MPS shares memory).
PIN_MEMORY = frozenset({"cuda", "npu", "xpu"})
# What a missing device type needs (the error names it).
INSTALL = {
    "cuda": "an NVIDIA GPU with its driver and a CUDA build of PyTorch "
            "(pip install torch --index-url https://download.pytorch.org/whl/cu128)",
    "npu": "an Ascend NPU with CANN and the PyTorch adapter (pip install torch-npu, the version "
           "matching your torch)",
    "xpu": "an Intel GPU with its driver and an XPU build of PyTorch "
           "(pip install torch --index-url https://download.pytorch.org/whl/xpu)",
    "mps": "macOS on Apple silicon (PyTorch's MPS backend)",
}


def vendor_module(device_type: str) -> ModuleType | None:
    """``torch.<device_type>`` (importing ``torch_npu`` first for ``npu``), None if absent."""
    if device_type == "npu" and not hasattr(torch, "npu"):
        if importlib.util.find_spec("torch_npu") is None:
            return None
        importlib.import_module("torch_npu")  # registers torch.npu and the hccl backend
    return getattr(torch, device_type, None)


def is_available(device_type: str) -> bool:
    if device_type == "cpu":
        return True
    if device_type == "mps":
        return torch.backends.mps.is_available()
    module = vendor_module(device_type)
    return module is not None and bool(module.is_available())


def accelerator_type() -> str | None:
    """The accelerator this machine has ("cuda", "npu", "xpu", "mps"), or None (CPU only).
    Importing ``torch_npu`` is what makes an NPU visible, so it comes first when installed."""
    if importlib.util.find_spec("torch_npu") is not None:
        vendor_module("npu")
    acc = torch.accelerator.current_accelerator(check_available=True)
    return acc.type if acc is not None else None


def pick_device(choice: str, *, world_size: int = 1, key: str = "training.device"
                ) -> torch.device:
    """The device of this process: ``choice`` is one of ``DEVICES``; the index is LOCAL_RANK.
    ``key``: where the choice came from, for the messages (a command's ``--device``)."""
    said = (lambda v: f"{key} {v}") if key.startswith("--") else (lambda v: f'{key} = "{v}"')
    if choice not in DEVICES:
        raise RecipeError(f"{said(choice)}: use one of {', '.join(DEVICES)}")
    kind = (accelerator_type() or "cpu") if choice == "auto" else choice
    if not is_available(kind):
        raise RecipeError(
            f"{said(kind)} but this machine has no usable {kind} device: it needs "
            f"{INSTALL[kind]}; or use {said('auto')} (the accelerator present, else the CPU)"
        )
    if kind == "mps" and world_size > 1:
        raise RecipeError(
            f"training.device = {choice!r} picked mps, which has one device and no collective "
            f"library: {world_size} processes cannot share it. Train in one process, or set "
            "training.device = \"cpu\""
        )
    if kind in ("cpu", "mps"):
        return torch.device(kind)
    return torch.device(kind, int(os.environ.get("LOCAL_RANK", 0)))


def set_current(device: torch.device) -> None:
    """Make ``device`` the current one of its type (collectives and new tensors use it)."""
    if device.type in ("cpu", "mps"):
        return
    torch.accelerator.set_device_index(device.index or 0)


def backend_for(device_type: str) -> str:
    return BACKENDS[device_type]


def device_type_of_backend(backend: str) -> str:
    """The device type a backend's collectives take tensors on: the accelerator of an
    accelerator library (also in a "cpu:gloo,cuda:nccl" pair), else the CPU."""
    for part in str(backend).lower().split(","):
        name = part.rsplit(":", 1)[-1]
        for kind, library in BACKENDS.items():
            if library == name and kind not in ("cpu", "mps"):
                return kind
    return "cpu"


def device_of_backend(backend: str) -> torch.device:
    """The device (with the current index) a backend's collectives take tensors on."""
    kind = device_type_of_backend(backend)
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.accelerator.current_device_index())


def pin_memory_supported() -> bool:
    """Whether pinned host buffers help: an accelerator that copies from them is present."""
    return accelerator_type() in PIN_MEMORY


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (timing); nothing to wait for on the CPU."""
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    """Peak bytes allocated by tensors on ``device`` (None: the CPU, measure RSS instead)."""
    if device.type == "cpu":
        return None
    if device.type == "mps":  # no peak counter: what the allocator holds now
        return int(torch.mps.driver_allocated_memory())
    return int(torch.accelerator.max_memory_allocated(device))


def reset_peak_memory(device: torch.device) -> None:
    if device.type not in ("cpu", "mps"):
        torch.accelerator.reset_peak_memory_stats(device)


def rng_device_type() -> str | None:
    """The accelerator whose generators a checkpoint saves, if one is in use in this process
    (a CUDA machine training on the CPU has initialised none: nothing to save)."""
    kind = accelerator_type()
    if kind is None or kind == "mps":
        return kind
    initialized = getattr(vendor_module(kind), "is_initialized", None)
    return kind if initialized is None or initialized() else None


def rng_states(device_type: str) -> list[torch.Tensor]:
    """Every ``device_type`` device's generator state (CPU byte tensors)."""
    if device_type == "mps":
        return [torch.mps.get_rng_state().cpu()]
    module = vendor_module(device_type)
    return [module.get_rng_state(i).cpu() for i in range(module.device_count())]


def device_count(device_type: str) -> int:
    return 1 if device_type == "mps" else int(vendor_module(device_type).device_count())


def set_rng_states(device_type: str, states: list[torch.Tensor]) -> None:
    if device_type == "mps":
        torch.mps.set_rng_state(states[0])
        return
    module = vendor_module(device_type)
    for i, state in enumerate(states):
        module.set_rng_state(state, i)

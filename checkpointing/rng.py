"""Per-rank RNG state (python, numpy, torch CPU, the accelerator's devices: CUDA, NPU, XPU or
MPS) as tensors plus JSON, never pickle, and the per-step derivation that makes a resume on
another layout need no RNG mapping.

``seed_step(seed, step)`` (called by the trainer before every step) sets every generator from
(seed, step) alone: all ranks draw the same numbers, as they did from the shared start seed
before, so replicas stay identical (e.g. stochastic rounding) and nothing random depends on the
number of processes or the mesh. A checkpoint still stores each rank's generators; a resume on
the same layout restores them (bit-exact either way), another layout simply re-derives them.

``capture()`` returns ``(tensors, info)``: the long state vectors as tensors (written to the
rank's safetensors file) and the few scalars as a JSON-able dict (written beside them as the
file's metadata). ``restore(tensors, info)`` validates everything before touching any generator,
so a bad file leaves the process's RNG as it was.
"""

from __future__ import annotations

import math
import random

import numpy as np
import torch

from kiln.components import devices
from kiln.components.errors import CheckpointError

PREFIX = "rng."
_MT_WORDS = 624  # Mersenne Twister state words (python and numpy's legacy generator)


def seed_step(seed: int, step: int) -> None:
    """Seed python, numpy, torch and every accelerator device from (seed, step)."""
    words = np.random.SeedSequence([seed % 2**64, int(step)]).generate_state(2, np.uint32)
    random.seed(int(words[0]) << 32 | int(words[1]))
    np.random.seed(int(words[0]))
    value = int(words[0]) << 31 | int(words[1]) >> 1
    # torch.manual_seed(value) would also queue a seed for every accelerator backend that is not
    # initialised (XPU, MTIA, and CUDA on a CPU run), formatting a stack trace for each: 1.2 ms
    # a step, 9% of a tiny model's step on CPU. Seed the CPU and this machine's accelerator
    # (CUDA, XPU, MPS, or an NPU once torch_npu is imported) only.
    torch.default_generator.manual_seed(value)
    acc = torch.accelerator.current_accelerator(check_available=True)
    if acc is not None:
        module = getattr(torch, acc.type)
        getattr(module, "manual_seed_all", module.manual_seed)(value)


def capture() -> tuple[dict[str, torch.Tensor], dict]:
    version, py_state, py_gauss = random.getstate()
    kind_np, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    tensors = {
        PREFIX + "torch": torch.get_rng_state(),  # uint8 (5056,)
        PREFIX + "python": torch.tensor(py_state, dtype=torch.int64),  # 624 words + position
        PREFIX + "numpy": torch.from_numpy(np.asarray(np_key, dtype=np.int64)),  # (624,)
    }
    kind = devices.rng_device_type()
    states = devices.rng_states(kind) if kind is not None else []
    for i, state in enumerate(states):
        tensors[f"{PREFIX}{kind}.{i}"] = state
    info = {
        "python": {"version": version, "gauss_next": py_gauss},
        "numpy": {"kind": kind_np, "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                  "cached_gaussian": float(np_gauss)},
        "accelerator": {"type": kind or "", "count": len(states)},
    }
    return tensors, info


def restore(tensors: dict[str, torch.Tensor], info: dict, where: str = "checkpoint") -> None:
    """Set every generator from a capture; raises CheckpointError before changing anything.
    The accelerator's generators are set when this process has that device type (a resume on
    other hardware re-derives them from (seed, step) before the next step anyway)."""
    py, npy, (kind, count) = _validate(tensors, info, where)
    torch_state = tensors[PREFIX + "torch"]
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(torch_state.contiguous())
    if count and devices.accelerator_type() == kind:
        if count != devices.device_count(kind):
            raise CheckpointError(
                f"{where}: RNG state was saved for {count} {kind} devices per process, this "
                f"process sees {devices.device_count(kind)}; resume with the same devices"
            )
        devices.set_rng_states(kind, [tensors[f"{PREFIX}{kind}.{i}"] for i in range(count)])


def _validate(tensors: dict[str, torch.Tensor], info: dict,
              where: str) -> tuple[tuple, tuple, tuple[str, int]]:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: invalid RNG state ({what}); the file is corrupt or was "
                               "edited. Resume from another checkpoint.")

    if not isinstance(info, dict):
        raise bad("fields")
    acc = _accelerator(info, bad)
    kind, count = acc
    expected = {PREFIX + k for k in ("torch", "python", "numpy")}
    expected |= {f"{PREFIX}{kind}.{i}" for i in range(count)}
    if set(tensors) != expected:
        raise bad(f"tensors {sorted(tensors)}")
    t, p, n = (tensors[PREFIX + k] for k in ("torch", "python", "numpy"))
    if t.dtype != torch.uint8 or t.dim() != 1:
        raise bad("torch generator")
    if p.dtype != torch.int64 or p.shape != (_MT_WORDS + 1,) or n.shape != (_MT_WORDS,):
        raise bad("Mersenne Twister shapes")
    if (p[:_MT_WORDS] < 0).any() or (p[:_MT_WORDS] >= 2**32).any() or not 0 <= p[-1] <= _MT_WORDS:
        raise bad("python words")
    if (n < 0).any() or (n >= 2**32).any():
        raise bad("numpy words")
    pi, ni = info["python"], info["numpy"]
    if not isinstance(pi, dict) or set(pi) != {"version", "gauss_next"} or type(pi["version"]) \
            is not int or not (pi["gauss_next"] is None or _finite(pi["gauss_next"])):
        raise bad("python scalars")
    if not isinstance(ni, dict) or set(ni) != {"kind", "pos", "has_gauss", "cached_gaussian"} \
            or ni["kind"] != "MT19937" or type(ni["pos"]) is not int \
            or not 0 <= ni["pos"] <= _MT_WORDS or ni["has_gauss"] not in (0, 1) \
            or not _finite(ni["cached_gaussian"]):
        raise bad("numpy scalars")
    py = (pi["version"], tuple(int(x) for x in p.tolist()), pi["gauss_next"])
    npy = ("MT19937", n.numpy().astype(np.uint32), ni["pos"], ni["has_gauss"],
           float(ni["cached_gaussian"]))
    return py, npy, acc


def _accelerator(info: dict, bad) -> tuple[str, int]:
    """(device type, device count) of the saved accelerator generators. Checkpoints written
    before other accelerators existed say ``cuda_devices: N`` instead."""
    if set(info) == {"python", "numpy", "cuda_devices"}:
        count = info["cuda_devices"]
        kind = "cuda" if count else ""
    elif set(info) == {"python", "numpy", "accelerator"} and isinstance(info["accelerator"], dict) \
            and set(info["accelerator"]) == {"type", "count"}:
        kind, count = info["accelerator"]["type"], info["accelerator"]["count"]
    else:
        raise bad("fields")
    accelerators = ("", *(d for d in devices.DEVICES if d not in ("auto", "cpu")))
    if type(count) is not int or count < 0 or kind not in accelerators \
            or (count > 0) != bool(kind):
        raise bad(f"accelerator {kind!r} x {count!r}")
    return kind, count


def _finite(x: object) -> bool:
    return type(x) in (int, float) and math.isfinite(x)

"""Per-rank RNG state (python, numpy, torch CPU, CUDA) as tensors plus JSON, never pickle, and
the per-step derivation that makes a resume on another layout need no RNG mapping.

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

from kiln.components.errors import CheckpointError

PREFIX = "rng."
_MT_WORDS = 624  # Mersenne Twister state words (python and numpy's legacy generator)


def seed_step(seed: int, step: int) -> None:
    """Seed python, numpy, torch and every CUDA device from (seed, step)."""
    words = np.random.SeedSequence([seed % 2**64, int(step)]).generate_state(2, np.uint32)
    random.seed(int(words[0]) << 32 | int(words[1]))
    np.random.seed(int(words[0]))
    value = int(words[0]) << 31 | int(words[1]) >> 1
    # torch.manual_seed(value) would also queue a seed for every accelerator backend that is not
    # initialised (XPU, MTIA, and CUDA on a CPU run), formatting a stack trace for each: 1.2 ms
    # a step, 9% of a tiny model's step on CPU. kiln trains on the CPU or CUDA: seed those.
    torch.default_generator.manual_seed(value)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(value)


def capture() -> tuple[dict[str, torch.Tensor], dict]:
    version, py_state, py_gauss = random.getstate()
    kind, np_key, np_pos, np_has_gauss, np_gauss = np.random.get_state(legacy=True)
    tensors = {
        PREFIX + "torch": torch.get_rng_state(),  # uint8 (5056,)
        PREFIX + "python": torch.tensor(py_state, dtype=torch.int64),  # 624 words + position
        PREFIX + "numpy": torch.from_numpy(np.asarray(np_key, dtype=np.int64)),  # (624,)
    }
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    for i, state in enumerate(cuda):
        tensors[f"{PREFIX}cuda.{i}"] = state.cpu()
    info = {
        "python": {"version": version, "gauss_next": py_gauss},
        "numpy": {"kind": kind, "pos": int(np_pos), "has_gauss": int(np_has_gauss),
                  "cached_gaussian": float(np_gauss)},
        "cuda_devices": len(cuda),
    }
    return tensors, info


def restore(tensors: dict[str, torch.Tensor], info: dict, where: str = "checkpoint") -> None:
    """Set every generator from a capture; raises CheckpointError before changing anything."""
    py, npy = _validate(tensors, info, where)
    torch_state = tensors[PREFIX + "torch"]
    random.setstate(py)
    np.random.set_state(npy)
    torch.set_rng_state(torch_state.contiguous())
    n_cuda = info["cuda_devices"]
    if n_cuda and torch.cuda.is_available():
        states = [tensors[f"{PREFIX}cuda.{i}"] for i in range(n_cuda)]
        if len(states) != torch.cuda.device_count():
            raise CheckpointError(
                f"{where}: RNG state was saved for {n_cuda} CUDA devices per process, this process "
                f"sees {torch.cuda.device_count()}; resume with the same devices"
            )
        torch.cuda.set_rng_state_all(states)


def _validate(tensors: dict[str, torch.Tensor], info: dict, where: str) -> tuple[tuple, tuple]:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: invalid RNG state ({what}); the file is corrupt or was "
                               "edited. Resume from another checkpoint.")

    if not isinstance(info, dict) or set(info) != {"python", "numpy", "cuda_devices"}:
        raise bad("fields")
    n_cuda = info["cuda_devices"]
    expected = {PREFIX + k for k in ("torch", "python", "numpy")}
    expected |= {f"{PREFIX}cuda.{i}" for i in range(n_cuda if type(n_cuda) is int else 0)}
    if type(n_cuda) is not int or n_cuda < 0 or set(tensors) != expected:
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
    return py, npy


def _finite(x: object) -> bool:
    return type(x) in (int, float) and math.isfinite(x)

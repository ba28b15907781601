"""Peak resident memory of one DPO step with LoRA (rank 8 on q/k/v/o, ``dpo.py``'s batch): the
reference as the policy with its adapters switched off (kiln's default with an adapter: no
second copy of the weights) against a frozen copy of the base. Each side runs in a fresh
process, so the peak is its own. A report, not a race.

The model is the Llama debug recipe widened to 60M parameters (``WIDE``: 229.5 MiB of fp32
weights, seeded random init: the memory does not depend on the values), so that one copy of
the weights stands well above the rest of the process. glibc's malloc is told to serve every
allocation of 64 KiB or more from its own mapping (``M_MMAP_THRESHOLD``) before torch
allocates: with its default, self-adjusting threshold, freed activations stayed mapped or not
from run to run and the peak moved by up to 200 MiB between identical runs; fixed, identical
runs peaked within 0.3 MiB of each other (AMD EPYC, 2026-12-06).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import resource

from bench_rows.common import REPO, set_threads

WIDE = ["--model.dim=768", "--model.n_layers=8", "--model.attention.n_heads=12",
        "--model.attention.n_kv_heads=12", "--model.ffn.hidden_dim=2048"]
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)


def _fixed_mmap_threshold() -> bool:
    """Large allocations mapped and unmapped one by one (module doc); False off glibc."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(M_MMAP_THRESHOLD, 1 << 16))
    except AttributeError:  # a C library without mallopt (musl, macOS)
        return False


def _side(p: dict, reference: str) -> dict:
    fixed = _fixed_mmap_threshold()  # before torch allocates anything
    import torch

    from bench_rows.dpo import kiln_step
    from bench_rows.lora import ALPHA, RANK
    from kiln.components.adapters.lora import LoRA, LoRAConfig
    from kiln.recipes.config.files import load_recipe

    set_threads(p["threads"])
    recipe = load_recipe(str(REPO / "train_configs" / "llama_debug.toml"), WIDE)
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=2048, seq_len=256)
    LoRA(LoRAConfig(type="lora", rank=RANK, alpha=ALPHA)).apply(model)
    run = kiln_step(model.train(), p, reference=reference)
    run()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    params = sum(q.numel() * q.element_size() for q in model.parameters()) / 2**20
    return {"peak_mb": peak, "model_mb": params, "mmap_threshold_fixed": fixed}


def kiln(p: dict) -> dict:
    return _side(p, "adapters_off")


def peer(p: dict) -> dict:
    return _side(p, "frozen_copy")

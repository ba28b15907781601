"""Per-block ``torch.compile``: the repeated blocks compile once and reuse the code.

Blocks are compiled in place (``nn.Module.compile``), so parameter names and state-dict keys stay
those of the eager model (no ``_orig_mod.`` prefix in checkpoints). Compilation is lazy (first
forward), so the toolchain is checked up front: a missing C++ compiler (CPU) or Triton (CUDA)
would otherwise fail deep inside the first step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kiln.components.errors import KilnError
from kiln.components.torchao_import import quiet_compile
from kiln.parallelisms.blocks import model_blocks
from kiln.parallelisms.config import ParallelismConfig


def check_toolchain(device: torch.device) -> None:
    """Raise a KilnError saying what to install when inductor cannot compile for ``device``."""
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise KilnError(
                "parallelism.compile needs Triton on CUDA (torch.compile's inductor backend) "
                "and it is not importable; install the `triton` build matching your torch, or "
                "set parallelism.compile = false"
            )
        return
    from torch._inductor import exc
    from torch._inductor.cpp_builder import get_cpp_compiler

    try:
        get_cpp_compiler()
    except (exc.InvalidCxxCompiler, RuntimeError) as err:
        raise KilnError(
            "parallelism.compile needs a C++ compiler on CPU (torch.compile's inductor backend "
            f"builds C++ kernels) and none was found ({err}); install g++ (or set CXX), or set "
            "parallelism.compile = false"
        ) from err


def apply_compile(model: nn.Module, cfg: ParallelismConfig, device: torch.device) -> str:
    """Compile every block in place; return a description ("" when off)."""
    if not cfg.compile:
        return ""
    _prepare(cfg, device)
    for block in model_blocks(model):
        block.compile(fullgraph=cfg.compile_fullgraph, backend=cfg.compile_backend)
    notes = ["fullgraph"] if cfg.compile_fullgraph else []
    if cfg.compile_backend != "inductor":
        notes.append(cfg.compile_backend)
    return "compile per block" + (f" ({', '.join(notes)})" if notes else "")


def compile_loss(fn: Callable, cfg: ParallelismConfig, device: torch.device) -> Callable:
    """The loss function, compiled when ``compile_loss`` is set."""
    if not cfg.compile_loss:
        return fn
    _prepare(cfg, device)
    return torch.compile(fn, fullgraph=cfg.compile_fullgraph, backend=cfg.compile_backend)


def _prepare(cfg: ParallelismConfig, device: torch.device) -> None:
    if cfg.compile_backend == "inductor":  # the other backends generate no code
        check_toolchain(device)
    quiet_compile()

"""float8 training via torchao: swap eligible ``nn.Linear`` layers for ``Float8Linear``.

The filter keeps the numerically sensitive or tiny layers in high precision: the LM head, norms
and embeddings (by name: ``ALWAYS_EXCLUDED`` plus ``float8_exclude``), subclasses of
``nn.Linear`` (the MoE router, which computes in fp32), layers with a dimension
below ``float8_min_dim`` (the casts cost more than the fp8 matmul saves) and layers whose
dimensions are not multiples of 16 (a ``torch._scaled_mm`` kernel constraint on CUDA; kept on
CPU too so a recipe converts the same layers everywhere).

On CPU the fp8 matmuls are emulated by default (``float8_emulate``, torchao's ``emulate``): the
operands are cast to fp8 and scaled exactly as on a GPU, then multiplied as float32. CPUs have
no fp8 matmul units, and ``torch._scaled_mm``'s CPU kernel is a reference loop about 100 times
slower than a float32 matmul (62 ms against 0.35 ms for 512 x 64 x 128 on a 2-core Xeon); the
two agree to float32 rounding (``tests/parallelisms/test_float8.py``).

torchao is imported lazily: its import logs warnings about optional CUDA extensions.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from fnmatch import fnmatchcase

import torch
from torch import nn

from kiln.components import registry
from kiln.components.errors import KilnError
from kiln.components.torchao_import import import_torchao
from kiln.parallelisms.blocks import clean_name
from kiln.parallelisms.config import ParallelismConfig

FP8_MIN_CAPABILITY = (8, 9)  # Ada / Hopper and newer have fp8 tensor cores
ALWAYS_EXCLUDED = ("output", "lm_head", "*norm*", "*embed*")  # LM head, norms, embeddings


def _torchao_float8():
    return import_torchao("torchao.float8")


def float8_filter(cfg: ParallelismConfig) -> Callable[[nn.Module, str], bool]:
    """``(module, fqn) -> convert?`` for torchao's ``module_filter_fn``."""

    def keep(module: nn.Module, fqn: str) -> bool:
        if type(module) is not nn.Linear:  # a subclass computes its own way (the fp32 router)
            return False
        name = clean_name(fqn)
        if any(fnmatchcase(name, pat) for pat in (*ALWAYS_EXCLUDED, *cfg.float8_exclude)):
            return False
        dims = (module.in_features, module.out_features)
        return min(dims) >= cfg.float8_min_dim and all(d % 16 == 0 for d in dims)

    return keep


@functools.lru_cache(maxsize=1)
def cpu_rowwise_scaled_mm() -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` takes row-wise scales (torch 2.11 asserts
    per-tensor scales on CPU; 2.13 takes both): probed once on a 16 x 16 product."""
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    b = torch.ones(16, 16).to(torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def float8_support(device: torch.device, recipe: str = "tensorwise") -> str | None:
    """None if ``device`` can run float8 matmuls with ``recipe``'s scaling; else why not."""
    if device.type != "cuda":  # CPU runs torch._scaled_mm's reference kernel (float8_emulate=off)
        if recipe != "tensorwise" and not cpu_rowwise_scaled_mm():
            return (f"this torch ({torch.__version__}) has no row-wise scaled matmul on CPU "
                    "(torch >= 2.13 has; GPUs have it)")
        return None
    cap = torch.cuda.get_device_capability(device)
    if cap < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"{name} (compute capability {cap[0]}.{cap[1]}) has no fp8 tensor cores; float8 "
            f"needs {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}+ (Ada, Hopper, Blackwell)"
        )
    return None


def float8_emulated(cfg: ParallelismConfig, device: torch.device) -> bool:
    """Whether the fp8 matmuls run emulated (``float8_emulate``; auto: on CPU, which has no fp8
    matmul units and whose ``torch._scaled_mm`` is a reference kernel)."""
    return cfg.float8_emulate == "on" or (cfg.float8_emulate == "auto" and device.type == "cpu")


def float8_config(cfg: ParallelismConfig, fsdp: bool, emulate: bool = False,
                  pad: bool = False):
    """torchao's ``Float8LinearConfig`` for the recipe (float8 all-gather for tensorwise+FSDP;
    ``emulate``: float32 matmuls of the dequantized fp8 operands; ``pad``: ``float8_pad``)."""
    f8 = _torchao_float8()
    config = f8.Float8LinearConfig.from_recipe_name(cfg.float8)
    if cfg.float8 == "tensorwise" and fsdp and cfg.float8_fsdp_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    return dataclasses.replace(config, emulate=emulate, pad_inner_dim=pad)


def float8_pad(cfg: ParallelismConfig, training=None, cp: int = 1) -> bool:
    """``float8_pad_inner_dim``: whether the fp8 matmuls pad their inner dimension to a
    multiple of 16. A GPU's ``torch._scaled_mm`` refuses another (CPU kernels and emulation
    take any), and the weight gradient's inner dimension is the micro-batch's token count on a
    rank (micro_batch x seq_len / cp), which kiln's layer filter cannot see. ``auto`` pads where
    that count can miss the multiple: a step that trims or packs its rows (``varying_width``), a
    context warmup's shorter lengths, or the fixed shape itself; and where ``training`` (the
    ``[training]`` table) is not known. Padding copies the operands, so a run whose count is
    always a multiple of 16 does without."""
    if cfg.float8_pad_inner_dim != "auto":
        return cfg.float8_pad_inner_dim == "on"
    if cfg.float8 == "rowwise_with_gw_hp":  # its weight gradient stays in high precision
        return False
    if training is None:
        return True
    step = registry.for_config(training.step).obj
    if getattr(step, "varying_width", False):
        return True
    warmup = training.context_warmup
    lengths = [training.seq_len, *([warmup.multiple] if warmup.steps else [])]
    return any(training.micro_batch * length % (16 * cp) for length in lengths)


def apply_float8(
    model: nn.Module, cfg: ParallelismConfig, device: torch.device, fsdp: bool,
    pad: bool = False,
) -> tuple[list[str], str]:
    """Convert the filtered Linear layers in place (``pad``: ``float8_pad``); return (converted
    names, a note).

    The note is empty, or says why float8 was skipped (``float8_fallback`` on hardware without
    fp8). Without the fallback, such hardware is an error. Emulated float8 runs anywhere.
    """
    if cfg.float8 == "off":
        return [], ""
    emulate = float8_emulated(cfg, device)
    problem = None if emulate else float8_support(device, cfg.float8)
    if problem is not None:
        if not cfg.float8_fallback:
            raise KilnError(
                f"parallelism.float8 = {cfg.float8!r}: {problem}. Set parallelism.float8 = "
                "\"off\", or parallelism.float8_fallback = true to train in high precision"
            )
        return [], f"float8 {cfg.float8} skipped: {problem} (float8_fallback)"
    keep = float8_filter(cfg)
    chosen = [clean_name(n) for n, m in model.named_modules() if keep(m, n)]
    if not chosen:
        return [], f"float8 {cfg.float8}: no Linear layer passes the filter"
    f8 = _torchao_float8()
    f8.convert_to_float8_training(model, module_filter_fn=keep,
                                  config=float8_config(cfg, fsdp, emulate, pad))
    from torchao.float8.float8_linear import Float8Linear

    converted = [clean_name(n) for n, m in model.named_modules() if isinstance(m, Float8Linear)]
    return converted, ""


def float8_post_optimizer_step(model: nn.Module) -> None:
    """tensorwise + float8 all-gather: compute next step's weight scales in one collective."""
    _torchao_float8().precompute_float8_dynamic_scale_for_fsdp(model)

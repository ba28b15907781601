"""Token dispatch for mixture-of-experts layers: sort assignments by expert, run every expert's
SwiGLU on its contiguous rows, and undo the sort.

Two interchangeable kernels compute the experts on sorted rows:

- ``grouped``: ``torch._grouped_mm`` (one call per weight for all experts; offsets stay on the
  device, so no host sync). Runs on CPU in fp32 and bf16 (checked on torch 2.13). Its backward
  rejects a non-contiguous upstream gradient (``.sum().backward()`` hands it an expanded one), so
  the output passes through ``_contiguous_grad`` first.
- ``loop``: one matmul per expert with tokens; needs the per-expert counts on the host (one sync
  per layer call). The fallback where ``_grouped_mm`` is missing or rejects the dtype/device.
"""

from __future__ import annotations

import functools
import logging
import threading

import torch
import torch.nn.functional as F

from kiln.components.errors import RecipeError

log = logging.getLogger(__name__)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous (see module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x) if x.requires_grad else x


def sort_by_expert(expert_ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order of the flat (N*k,) assignments grouped by expert (stable), and counts per expert."""
    order = torch.argsort(expert_ids, stable=True)  # (N*k,)
    counts = torch.bincount(expert_ids, minlength=n_experts)  # (E,)
    return order, counts


def _probe(device: torch.device, dtype: torch.dtype) -> bool:
    """``torch._grouped_mm`` forward and backward on a small problem; False where it fails."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return False
    try:
        # Fixed values, not torch.randn: the probe must not move the global RNG stream.
        x = torch.linspace(-1, 1, 24 * 16, device=device).view(24, 16).to(dtype)
        w = torch.linspace(-1, 1, 2 * 16 * 16, device=device).view(2, 16, 16).to(dtype)
        x.requires_grad_()
        w.requires_grad_()
        offs = torch.tensor([8, 24], device=device, dtype=torch.int32)
        _contiguous_grad(fn(x, w, offs=offs)).sum().backward()
        return x.grad is not None and w.grad is not None
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@functools.cache
def grouped_mm_works(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward on ``device`` in ``dtype``.

    Decided once per (device, dtype) by a probe on a fresh thread. Autograd state is
    thread-local, so the probe runs with gradients on and outside any activation-checkpointed
    region, ``no_grad`` block, autocast or dispatch mode of the caller: the answer does not
    depend on where the first MoE forward happens (inside a checkpointed block, whose recompute
    would then save a different number of tensors; or an evaluation under ``no_grad``, which
    made the probe fail and silently chose the slow kernel for the whole process).
    """
    device = torch.device(device)
    answer: list[bool] = []

    def run() -> None:
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the current device is per thread too
        answer.append(_probe(device, dtype))

    thread = threading.Thread(target=run, name="kiln-grouped-mm-probe")
    thread.start()
    thread.join()
    works = bool(answer and answer[0])
    log.info("kiln: MoE expert kernel on %s/%s: %s", device, str(dtype).removeprefix("torch."),
             "grouped (torch._grouped_mm)" if works else "loop (torch._grouped_mm unavailable)")
    return works


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return _contiguous_grad(torch._grouped_mm(x, w, offs=offs))


def experts_grouped(
    xs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of every expert on its rows of ``xs`` (sorted by expert), via ``_grouped_mm``.

    xs (M, D); w1, w3 (E, D, F); w2 (E, F, D); counts (E,) rows per expert -> (M, D).
    """
    offs = torch.cumsum(counts, 0).to(torch.int32)  # (E,) end row of each expert
    h = F.silu(_grouped_mm(xs, w1, offs)) * _grouped_mm(xs, w3, offs)  # (M, F)
    return _grouped_mm(h, w2, offs)  # (M, D)


def experts_loop(
    xs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Same contract as ``experts_grouped``; one matmul chain per expert that has rows.

    ``split``/``unbind`` rather than slicing and indexing: their backward is one ``cat``/``stack``,
    where each slice or index would write its gradient into a zero tensor of the full size
    (measured 30x slower backward with 64 experts).
    """
    sizes = counts.tolist()  # the one host sync of this path
    parts = xs.split(sizes)  # per expert (n_e, D)
    outs = [
        (F.silu(x @ a) * (x @ c)) @ b  # (n_e, D)
        for x, a, c, b, n in zip(parts, w1.unbind(0), w3.unbind(0), w2.unbind(0), sizes,
                                 strict=True)
        if n
    ]
    if not outs:
        return xs.new_zeros(xs.shape[0], w2.shape[-1])
    return torch.cat(outs, 0)


def resolve_kernel(kind: str, device: torch.device, dtype: torch.dtype,
                   widths: tuple[int, ...] = (), compiling: bool = False) -> str:
    """``grouped`` or ``loop`` for a configured ``dispatch`` (``auto``: grouped where it works).

    ``widths``: the experts' matrix widths (model dim, hidden width). ``_grouped_mm`` needs
    each row to be a multiple of 16 bytes (4 fp32 or 8 bf16 values); it raised a bare
    "strides should be multiple of 16 bytes" at the first forward (hidden_dim = 7).
    ``compiling``: under ``torch.compile`` the op's fake-tensor kernel takes bf16 only (torch
    2.13), so a compiled fp32 model failed to trace it; auto takes the loop there."""
    if compiling and dtype != torch.bfloat16:
        if kind == "grouped":
            raise RecipeError(
                "model.ffn.dispatch = \"grouped\" with parallelism.compile: torch.compile "
                f"traces torch._grouped_mm in bfloat16 only, and the experts run in "
                f"{str(dtype).removeprefix('torch.')}; use dispatch = \"auto\" or \"loop\", or "
                "training.mixed_precision = \"bf16\"")
        return "loop" if kind == "auto" else kind
    odd = [w for w in widths if w * dtype.itemsize % 16]
    if kind == "grouped" and odd:
        raise RecipeError(
            f"model.ffn.dispatch = \"grouped\": torch._grouped_mm needs widths that are a "
            f"multiple of {16 // dtype.itemsize} in {str(dtype).removeprefix('torch.')}, and the "
            f"experts have {', '.join(map(str, widths))}; use dispatch = \"auto\" or \"loop\", "
            "or change model.dim / model.ffn.hidden_dim")
    if kind != "auto":
        return kind
    if odd:
        return "loop"
    # the meta device (kiln validate) runs no kernel: nothing to probe
    return "grouped" if device.type == "meta" or grouped_mm_works(device, dtype) else "loop"


def expert_widths(layer: torch.nn.Module) -> tuple[int, int]:
    """An MoE layer's model dim and expert hidden width, as ``resolve_kernel`` takes them."""
    if hasattr(layer, "w13"):  # gpt-oss experts: w13 (E, D, 2F), w2 (E, F, D)
        return layer.w13.shape[-2], layer.w2.shape[-2]
    return layer.w1.shape[-2], layer.w1.shape[-1]  # w1 (E, D, F)


# Decided once, so torch.compile may trace it as a constant. This is what
# ``torch.compiler.assume_constant_result`` sets (torch 2.11-2.13); the decorator itself imports
# torch._dynamo (and with it FSDP2 and DTensor), which reading a recipe must not pay for.
resolve_kernel._dynamo_marked_constant = True  # type: ignore[attr-defined]


def run_experts(
    kind: str, xs: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
    counts: torch.Tensor,
) -> torch.Tensor:
    """Dispatch to a kernel: ``grouped``, ``loop`` or ``auto`` (grouped where it works).

    Under autocast the weights and rows are cast to the autocast dtype explicitly, because
    ``_grouped_mm`` is not on autocast's op lists.
    """
    dtype = xs.dtype
    if torch.is_autocast_enabled(xs.device.type):
        dtype = torch.get_autocast_dtype(xs.device.type)
    xs, w1, w3, w2 = (t.to(dtype) for t in (xs, w1, w3, w2))
    kind = resolve_kernel(kind, xs.device, dtype, (xs.shape[-1], w1.shape[-1]),
                          torch.compiler.is_compiling())
    if kind == "grouped":
        return experts_grouped(xs, w1, w3, w2, counts)
    return experts_loop(xs, w1, w3, w2, counts)


def gpt_oss_activation(h: torch.Tensor, limit: float, alpha: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU on (..., 2F) with gate and up interleaved -> (..., F)."""
    # unbind, not two strided slices: its backward is one stack where the slices' was a zeroed
    # copy of h each and their sum (1.2x faster forward and backward at (2048, 512) on CPU)
    gate, up = h.unflatten(-1, (-1, 2)).unbind(-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def run_gpt_oss_experts(
    kind: str, xs: torch.Tensor, w13: torch.Tensor, b13: torch.Tensor, w2: torch.Tensor,
    b2: torch.Tensor, counts: torch.Tensor, limit: float, alpha: float,
) -> torch.Tensor:
    """gpt-oss's biased experts on rows sorted by expert: w13 (E, D, 2F) with b13 (E, 2F),
    then w2 (E, F, D) with b2 (E, D); the ``run_experts`` kernels and casts."""
    dtype = xs.dtype
    if torch.is_autocast_enabled(xs.device.type):
        dtype = torch.get_autocast_dtype(xs.device.type)
    xs, w13, b13, w2, b2 = (t.to(dtype) for t in (xs, w13, b13, w2, b2))
    if resolve_kernel(kind, xs.device, dtype, (xs.shape[-1], w2.shape[-2]),
                      torch.compiler.is_compiling()) == "grouped":
        offs = torch.cumsum(counts, 0).to(torch.int32)
        rows = xs.shape[0]  # each row's expert biases, gathered by the counts
        h = _grouped_mm(xs, w13, offs) + b13.repeat_interleave(counts, 0, output_size=rows)
        out = _grouped_mm(gpt_oss_activation(h, limit, alpha), w2, offs)
        return out + b2.repeat_interleave(counts, 0, output_size=rows)
    outs = [torch.addmm(b2[e], gpt_oss_activation(torch.addmm(b13[e], x, w13[e]), limit, alpha),
                        w2[e])
            for e, x in enumerate(xs.split(counts.tolist())) if x.shape[0]]
    return torch.cat(outs) if outs else xs.new_zeros(0, w2.shape[-1])

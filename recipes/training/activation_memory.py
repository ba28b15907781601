"""Per-rank activation memory for ``kiln validate --world-size N``, measured on the meta device.

One micro-batch's forward runs on a meta copy of the model (no memory, no compute) with this
rank's share of the sequence (``micro_batch`` x ``seq_len / cp`` tokens, the keys and values of
the whole sequence under context parallel) and the recipe's attention context, inside
``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd keeps for the backward is
counted once per storage (parameters excluded); attention runs as the fused CPU kernel (on
meta, SDPA would otherwise take its math path and keep the whole score matrix). That is the
activation memory of the step's peak, in fp32 (the meta model's dtype; bf16 autocast roughly
halves it). With activation
checkpointing the checkpointed blocks keep only their inputs; tensor parallel (heads, hidden
units and sequence-parallel norms split over tp) divides most of it by tp, which is not
measured here. The dense mask of the ``sdpa`` kernel (document mask or context parallel) is
shown apart: SDPA saves it for the backward, (micro_batch, T / cp, T) x 4 bytes (fp32, one
shared by the layers), and CUDA's ``flex`` kernel replaces it with a block mask of a few bytes
per 128 x 128 tile.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from types import SimpleNamespace
from unittest import mock

import torch
import torch.nn.functional as F

from kiln.parallelisms.activation_checkpoint import apply_activation_checkpoint
from kiln.parallelisms.context_parallel import chunk_positions
from kiln.recipes.training.model_inputs import ModelInputs


def measure(recipe, model_builder: Callable[[], torch.nn.Module], cp: int,
            device: str = "meta") -> tuple[int, int]:
    """(bytes autograd saves in one micro-batch forward on one rank at ``cp``, of which the
    dense attention mask). ``model_builder()`` builds the recipe's model on ``device`` (on a
    real device the real kernels run: the test compares the two)."""
    tr = recipe.training
    model = model_builder()
    apply_activation_checkpoint(model, recipe.parallelism)
    length, mb = tr.seq_len, tr.micro_batch
    fake_cp = None
    if cp > 1:
        fake_cp = SimpleNamespace(
            size=cp, positions=lambda n, d: chunk_positions(n, cp, 0, d),
            # the whole sequence's keys / values
            gatherer=lambda n, d: lambda t: t.repeat(1, cp, 1, 1),
            describe=lambda: f"context parallel {cp}")
    inputs = ModelInputs(getattr(recipe.model, "attention", None), torch.device(device),
                         cp=fake_cp)
    inputs.kernel = "sdpa"  # the dense mask: counted, and shown apart
    ids = torch.zeros(mb, length, dtype=torch.long, device=device)
    batch = {"input_ids": ids, "labels": ids, "doc_ids": torch.zeros_like(ids, dtype=torch.int)}
    ids, labels, extra = inputs(batch)
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[int, int] = {}
    mask_bytes = 0
    masks: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal mask_bytes
        storage = t.untyped_storage()
        if storage._cdata not in params and storage._cdata not in saved:
            saved[storage._cdata] = storage.nbytes()
            if storage._cdata in masks:
                mask_bytes += storage.nbytes()
        return t

    def keep_input(module, args, kwargs) -> None:  # a checkpointed block keeps its input
        pack(args[0])

    hooks = [m.register_forward_pre_hook(keep_input, with_kwargs=True)
             for m in model.modules() if type(m).__name__ == "CheckpointWrapper"]
    fused = functools.partial(_fused_sdpa, masks)
    kernel = (mock.patch.object(F, "scaled_dot_product_attention", fused) if device == "meta"
              else contextlib.nullcontext())
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kernel:
            logits = model(ids, **extra)
            F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
    finally:
        for h in hooks:
            h.remove()
    return sum(saved.values()), mask_bytes


def _fused_sdpa(masks: set[int], q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False) -> torch.Tensor:
    """SDPA as the fused kernels run it, on meta: SDPA itself would take its math path there and
    save the (B, H, Tq, T) attention probabilities, which no fused kernel keeps. The CPU kernel
    saves the mask it attends with (a boolean one turned into an fp32 copy; recorded in
    ``masks``); GQA keys and
    values are expanded, as it does. Values wider than the keys (differential attention) widen
    q and k with zeros (the kernel takes one width; this counts q and k at the value width)."""
    if k.shape[1] != q.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if v.shape[-1] > q.shape[-1]:
        pad = (0, v.shape[-1] - q.shape[-1])
        scale = scale or q.shape[-1] ** -0.5
        q, k = F.pad(q, pad), F.pad(k, pad)
    if attn_mask is not None:
        if attn_mask.dtype != q.dtype:  # what the kernel saves: an fp32 (query dtype) copy
            attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device)
        masks.add(attn_mask.untyped_storage()._cdata)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

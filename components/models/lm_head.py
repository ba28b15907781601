"""The LM head (final projection + optional logit soft-cap) and a chunked cross-entropy over it.

Unchunked, a micro-batch of N tokens materialises its (N, V) logits several times over (the
projection's output, its fp32 copy, the soft-cap's intermediates, log-softmax saved for backward,
the gradient): at V = 65,536 and N = 12,288 each fp32 copy is 3.2 GB. ``ChunkedLoss`` computes the
loss ``chunk_tokens`` rows at a time and, for every chunk, its gradients with respect to the
hidden states and the head weight right away (the "fused linear + cross-entropy" of Liger-Kernel
and Apple's Cut Cross-Entropy, here with plain autograd per chunk), so at most one chunk's logits
exist at once and nothing of size (N, V) is saved for backward. The FLOPs are those of the
unchunked path (one projection forward, two backward matmuls): no recomputation.

Models opt in through the model protocol: ``forward(input_ids, head=fn)`` returns
``fn(*head_operands(hidden, output), softcap)`` instead of logits, with ``hidden`` the final-norm
output (B, T, D) and ``weight`` the head's (V, D) matrix, read inside ``forward`` so that FSDP2
has it unsharded. An adapter on the output layer widens both (``HeadExtension``), so the chunked
loss trains it too. Per-row results equal the unchunked ``logits()`` path; only the sum's
grouping differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100  # F.cross_entropy's default: rows with this label count for nothing


def soft_cap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(logits / cap)`` (Gemma 2); identity for cap 0."""
    return cap * torch.tanh(logits / cap) if cap else logits


def logits(hidden: torch.Tensor, output: nn.Module, cap: float) -> torch.Tensor:
    """The unchunked head: (B, T, D) -> (B, T, V) through the ``output`` module, soft-capped."""
    return soft_cap(output(hidden), cap)


@runtime_checkable
class HeadExtension(Protocol):
    """A trainable addition to the output layer that is a product of the hidden states, held
    as a child module of it (an adapter on ``output``). ``extend_head(hidden, weight)``, with
    the head's own (V, D) ``weight``, returns ``(extra_hidden (..., r), extra_weight (V, r))``
    whose product ``extra_hidden @ extra_weight.T`` is the addition to the logits: the chunked
    loss then sees the adapted projection by concatenation, and the gradient reaches the
    addition's parameters."""

    enabled: bool  # False: the head is the output layer's own (adapters switched off)

    def extend_head(self, hidden: torch.Tensor, weight: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def head_operands(hidden: torch.Tensor, output: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """What a model passes to ``head(hidden, weight, softcap)``: the final-norm output and the
    head's matrix, both widened by every ``HeadExtension`` on ``output``, so that
    ``hidden @ weight.T`` is the ``output`` module's own result (B, T, D + r), (V, D + r)."""
    extras = [m for m in output.children() if isinstance(m, HeadExtension) and m.enabled]
    if not extras:
        return hidden, output.weight
    hs, ws = [hidden], [output.weight]
    for extension in extras:
        h, w = extension.extend_head(hidden, output.weight)
        hs.append(h.to(hidden.dtype))
        ws.append(w.to(output.weight.dtype))
    return torch.cat(hs, dim=-1), torch.cat(ws, dim=1)


def chunk_loss_sum(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   cap: float) -> torch.Tensor:
    """Summed fp32 cross-entropy of one chunk: (n, D), (V, D), (n,) -> (). ``compile_loss``
    compiles this function (the trainer passes the compiled one in)."""
    z = soft_cap(F.linear(hidden, weight), cap).float()  # (n, V): the same ops as logits()
    return F.cross_entropy(z, labels, reduction="sum")


class TokenLosses:
    """A chunk loss (``LossFn``) that also keeps every token's loss, detached, in ``per_token``
    (N,): the chunks come in order, each right after the last. A mixture's per-source loss reads
    them; the step's loss and gradients are those of ``chunk_loss_sum`` (uncompiled here)."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.per_token = torch.zeros(n, dtype=torch.float32, device=device)
        self.at = 0

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                 cap: float) -> torch.Tensor:
        z = soft_cap(F.linear(hidden, weight), cap).float()  # (n, V)
        per = F.cross_entropy(z, labels, reduction="none")  # (n,)
        self.per_token[self.at:self.at + per.shape[0]] = per.detach()
        self.at += per.shape[0]
        return per.sum()


LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
HeadFn = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (hidden, weight, cap)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``softcap(hidden @ weight.T)``; gradients computed in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, cap, chunk, count, loss_fn):  # noqa: D401
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if need_h else None
        # fp32 accumulator across chunks (the head weight may be bf16 under FSDP2 mixed precision)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h = hidden[start:start + chunk].detach().requires_grad_(need_h)
            w = weight.detach().requires_grad_(need_w)
            with torch.enable_grad():
                loss = loss_fn(h, w, labels[start:start + chunk], cap) / count
                wanted = [t for t, need in ((h, need_h), (w, need_w)) if need]
                grads = torch.autograd.grad(loss, wanted)
            total += loss.detach()
            if need_h:
                grad_h[start:start + chunk] = grads[0]
            if need_w:
                grad_w += grads[-1]
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if need_w else None)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_h, grad_w = ctx.saved_tensors
        gh = grad_h * grad_out.to(grad_h.dtype) if grad_h is not None else None
        gw = grad_w * grad_out.to(grad_w.dtype) if grad_w is not None else None
        return gh, gw, None, None, None, None, None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                          cap: float = 0.0, chunk_tokens: int = 4096,
                          loss_fn: LossFn = chunk_loss_sum,
                          empty_is_zero: bool = False) -> torch.Tensor:
    """Mean cross-entropy (fp32, ``IGNORE_INDEX`` rows excluded) of the soft-capped head over
    ``hidden`` (..., D) against ``labels`` (...), ``chunk_tokens`` rows at a time; no valid
    row gives nan (as ``F.cross_entropy``'s mean), or 0 with ``empty_is_zero``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    h = hidden.reshape(-1, hidden.shape[-1])  # (N, D)
    y = labels.reshape(-1)  # (N,)
    count = (y != IGNORE_INDEX).sum()
    if empty_is_zero:
        count = count.clamp(min=1)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _ChunkedLinearCrossEntropy.apply(h, weight, y, cap, chunk_tokens, count, loss_fn)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk_tokens):
        total += loss_fn(h[start:start + chunk_tokens], weight, y[start:start + chunk_tokens],
                         cap)
    return total / count


class LossHead:
    """What the trainer passes as ``model(ids, head=...)``: the chunked loss against ``labels``."""

    def __init__(self, labels: torch.Tensor, chunk_tokens: int,
                 loss_fn: LossFn = chunk_loss_sum) -> None:
        self.labels, self.chunk_tokens, self.loss_fn = labels, chunk_tokens, loss_fn

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, cap: float) -> torch.Tensor:
        return chunked_cross_entropy(hidden, weight, self.labels, cap=cap,
                                     chunk_tokens=self.chunk_tokens, loss_fn=self.loss_fn)

"""Each token's log-probability of its label through the LM head, ``chunk_tokens`` rows at a
time: what sequence-level losses (preference pairs, RL with rewards) are built from.

Unlike the chunked cross-entropy (``lm_head.chunked_cross_entropy``), the result is one value
per token, so its gradient is known only in backward. The forward keeps no logits; the
backward computes each chunk's logits once more and pushes that chunk's per-token gradient
into the hidden states and the head weight. At most one chunk's (n, V) logits exist at once,
whatever the sequence length, for one extra head matmul per chunk (Liger-Kernel's fused linear
preference losses make the same trade).

The head runs on the tokens with a label only: a prompt's positions (``IGNORE_INDEX``) cost
no head matmul (one host read finds them; a batch without any runs them all, keeping the graph).

A model computes it through its ``head=`` hook: ``model(ids, head=LogprobHead(labels, n))``
returns the (B, T) log-probabilities, untrained positions (``IGNORE_INDEX``) holding 0. An
adapter on the output layer joins the head as extra columns (``lm_head.head_operands``), so its
gradient arrives here too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.components.models.lm_head import IGNORE_INDEX, soft_cap


def label_logprobs(z: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(z)[label] along the last dim, 0 where the label is ignored: (..., V), (...)
    -> (...). The unchunked path, for whole logits."""
    picked = z.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked - torch.logsumexp(z, dim=-1)) * (labels != IGNORE_INDEX)


def _chunk_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                    cap: float, temperature: float = 1.0, vocab: int | None = None
                    ) -> torch.Tensor:
    z = soft_cap(F.linear(hidden, weight[:vocab]), cap).float()
    return label_logprobs(z if temperature == 1 else z / temperature, labels)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """(N, D), (V, D), (N,) -> (N,) fp32 log-probabilities; logits recomputed in backward."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, cap, chunk, temperature, vocab):  # noqa: D401
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            end = start + chunk
            out[start:end] = _chunk_logprobs(hidden[start:end], weight, labels[start:end], cap,
                                             temperature, vocab)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.cap, ctx.chunk, ctx.temperature, ctx.vocab = cap, chunk, temperature, vocab
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, labels = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        # fp32 accumulator across chunks (the head weight may be bf16 under FSDP2 mixed precision)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if need_w else None
        for start in range(0, hidden.shape[0], ctx.chunk):
            end = start + ctx.chunk
            h = hidden[start:end].detach().requires_grad_(need_h)
            w = weight.detach().requires_grad_(need_w)
            with torch.enable_grad():
                lp = _chunk_logprobs(h, w, labels[start:end], ctx.cap, ctx.temperature,
                                     ctx.vocab)
                wanted = [t for t, need in ((h, need_h), (w, need_w)) if need]
                grads = torch.autograd.grad(lp, wanted, grad_out[start:end])
            if need_h:
                grad_h[start:end] = grads[0]
            if need_w:
                grad_w += grads[-1]
        return grad_h, grad_w.to(weight.dtype) if need_w else None, None, None, None, None, None


def chunked_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                           cap: float = 0.0, chunk_tokens: int = 4096,
                           temperature: float = 1.0, vocab: int | None = None) -> torch.Tensor:
    """log p(label) of every row of ``hidden`` (..., D) under the soft-capped head ``weight``
    (V, D), the logits divided by ``temperature`` and cut to the first ``vocab`` (a sampler's:
    a rounded-up vocabulary's padding rows are never sampled), fp32, shaped like ``labels``
    (...); 0 where a label is ``IGNORE_INDEX``."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    kept = (y != IGNORE_INDEX).nonzero().squeeze(1)  # (one host read)
    if 0 < kept.numel() < y.numel():  # the head on the trained tokens only (not a prompt's)
        picked = _logprobs(h[kept], weight, y[kept], cap, chunk_tokens, temperature, vocab)
        out = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
        return out.index_put((kept,), picked).view(labels.shape)
    return _logprobs(h, weight, y, cap, chunk_tokens, temperature, vocab).view(labels.shape)


def _logprobs(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, cap: float,
              chunk_tokens: int, temperature: float, vocab: int | None) -> torch.Tensor:
    """(N, D), (N,) -> (N,): ``chunked_token_logprobs`` of flat rows."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _ChunkedTokenLogprobs.apply(h, weight, y, cap, chunk_tokens, temperature, vocab)
    # no graph to keep: the forward alone
    return torch.cat([_chunk_logprobs(h[s:s + chunk_tokens], weight, y[s:s + chunk_tokens], cap,
                                      temperature, vocab)
                      for s in range(0, h.shape[0], chunk_tokens)])


class LogprobHead:
    """``model(ids, head=LogprobHead(labels, n))``: the (B, T) token log-probabilities."""

    def __init__(self, labels: torch.Tensor, chunk_tokens: int, temperature: float = 1.0,
                 vocab: int | None = None) -> None:
        self.labels, self.chunk_tokens = labels, chunk_tokens
        self.temperature, self.vocab = temperature, vocab

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, cap: float) -> torch.Tensor:
        return chunked_token_logprobs(hidden, weight, self.labels, cap=cap,
                                      chunk_tokens=self.chunk_tokens,
                                      temperature=self.temperature, vocab=self.vocab)

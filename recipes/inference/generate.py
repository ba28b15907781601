"""Sampling text from a kiln model: batched prompts (left-padded), a KV cache, temperature /
top-k / top-p sampling from a seeded generator, tokens handed to a callback as they come.

With the cache (``components/attention/kv_cache.py``) the prompt runs once and every later
forward runs one token per row; without it every step reruns the whole sequence (the reference
the cache is tested against, and the path for a plugin attention that has no cache).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kiln.components.attention import kv_cache


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""

    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0 or self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError("sampling: temperature >= 0, top_k >= 0 and 0 < top_p <= 1")


def sample(logits: torch.Tensor, s: Sampling, generator: torch.Generator) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V)."""
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / s.temperature
    if s.top_k and s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the more likely ones already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= s.top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _padded(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids (B, L) and their validity mask."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p)
            valid[i, width - len(p):] = True
    return ids.to(device), valid.to(device)


@torch.no_grad()
def generate(model: nn.Module, prompts: list[list[int]], *, max_new_tokens: int,
             sampling: Sampling = Sampling(), eos_id: int | None = None, use_cache: bool = True,
             loops: int | None = None, pad_id: int = 0, vocab_size: int | None = None,
             on_tokens: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
             until: Callable[[list[int]], bool] | None = None,
             all_done: Callable[[bool], bool] | None = None) -> list[list[int]]:
    """New tokens per prompt (a row stops after EOS, which it keeps). ``on_tokens(ids (B,),
    live (B,) bool)`` sees every step's tokens (those of finished rows are not live);
    ``loops`` is a looped model's loop count; ``vocab_size`` (the tokenizer's) keeps sampling
    off the padding rows of a model whose vocabulary was rounded up (``vocab_multiple``).
    ``until(row's new ids)`` stops a row when true (stop strings); ``all_done(this batch is
    done) -> every rank's is`` keeps data-parallel ranks stepping together (evaluation)."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("generate needs at least one non-empty prompt")
    device = next(model.parameters()).device
    model.eval()
    kwargs = {} if loops is None else {"loops": loops}
    ids, valid = _padded(prompts, pad_id, device)
    stops = _Stops(eos_id, until, all_done)
    if not use_cache or not kv_cache.supports_cache(model):
        if len({len(p) for p in prompts}) > 1:  # padding needs the cache's attention mask
            if all_done is not None:
                raise ValueError("generating prompts of several lengths in step with other "
                                 "ranks needs a model whose attention has a KV cache")
            return [generate(model, [p], max_new_tokens=max_new_tokens, sampling=sampling,
                             eos_id=eos_id, use_cache=use_cache, loops=loops, pad_id=pad_id,
                             vocab_size=vocab_size, on_tokens=None, until=until)[0]
                    for p in prompts]
        step = lambda new: model(  # noqa: E731
            torch.cat([ids, *new], 1), **kwargs)[:, -1, :vocab_size]
        return _loop(step, ids, max_new_tokens, sampling, stops, on_tokens)
    with kv_cache.attach(model, len(prompts), ids.shape[1] + max_new_tokens, device) as session:
        def step(new: list[torch.Tensor]) -> torch.Tensor:
            session.begin(None if new else valid)  # None: one valid token per row
            logits = model(ids if not new else new[-1], **kwargs)[:, -1, :vocab_size]  # (B, V)
            session.end()
            return logits

        return _loop(step, ids, max_new_tokens, sampling, stops, on_tokens)


@dataclass(frozen=True)
class _Stops:
    """When rows and the batch stop: EOS, a row's own test, every rank done."""

    eos_id: int | None
    until: Callable[[list[int]], bool] | None
    all_done: Callable[[bool], bool] | None

    def finished(self, done: torch.Tensor, token: torch.Tensor, out: list[list[int]]):
        finished = done | (token == self.eos_id) if self.eos_id is not None else done.clone()
        if self.until is not None:
            for i, d in enumerate(finished.tolist()):
                if not d and self.until(out[i]):
                    finished[i] = True
        return finished

    def batch_done(self, done: torch.Tensor) -> bool:
        local = bool(done.all())
        return local if self.all_done is None else self.all_done(local)


def _loop(step, ids: torch.Tensor, max_new_tokens: int, sampling: Sampling, stops: _Stops,
          on_tokens) -> list[list[int]]:
    """Sample ``max_new_tokens`` steps; ``step(new_columns) -> logits (B, V)``."""
    generator = torch.Generator(ids.device).manual_seed(sampling.seed)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    new: list[torch.Tensor] = []  # (B, 1) each
    out: list[list[int]] = [[] for _ in range(ids.shape[0])]
    for _ in range(max_new_tokens):
        token = sample(step(new), sampling, generator)  # (B,)
        token = torch.where(done, torch.zeros_like(token), token)
        for i, (t, d) in enumerate(zip(token.tolist(), done.tolist(), strict=True)):
            if not d:
                out[i].append(t)
        finished = stops.finished(done, token, out)
        if on_tokens is not None:
            on_tokens(token, ~done)
        done = finished
        new.append(token[:, None])
        if stops.batch_done(done):
            break
    return out

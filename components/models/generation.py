"""Sampling text from a kiln model: batched prompts (left-padded), a KV cache, temperature /
top-k / top-p sampling from a seeded generator (or one per row: ``row_seeds``), tokens handed to
a callback as they come.

With ``row_seeds`` each row draws from its own generator (one uniform per token, inverted
through the row's cumulative probabilities), so a row's tokens do not depend on which other rows
share its batch: RL rollouts give the same completions on 1 or 2 processes and after a resume.
``stats`` collects each sampled token's log-probability and the entropy of the distribution it
was drawn from (the logits divided by the temperature: what the training forward recomputes).

With the cache (``components/attention/kv_cache.py``) the prompt runs once and every later
forward runs one token per row; without it every step reruns the whole sequence (the reference
the cache is tested against, and the path for a plugin attention that has no cache).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.components.attention import kv_cache
from kiln.components.models.lm_head import soft_cap


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


def filtered(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """fp32 logits (B, V) divided by the temperature (> 0), then cut to the ``top_k`` largest
    (ties at the k-th kept), then to the fewest most likely tokens whose probability reaches
    ``top_p``: the order and rules of ``transformers``' temperature, top-k and top-p warpers.
    Cut tokens are ``-inf``."""
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
    return logits


def sample(logits: torch.Tensor, s: Sampling,
           generator: torch.Generator | list[torch.Generator]) -> torch.Tensor:
    """Next token ids (B,) from logits (B, V); ``generator``: one for the batch, or one per
    row."""
    if s.temperature == 0:
        return logits.argmax(-1)
    probs = filtered(logits, s).softmax(-1)
    if isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    # Per row (written here: multinomial draws a batch from one stream): the first token whose
    # cumulative probability exceeds the row's uniform (tokens of probability 0 never win).
    u = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generator])
    cdf = probs.double().cumsum(-1)
    at = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[:, -1])[:, None], right=True)
    return at.squeeze(-1).clamp(max=probs.shape[-1] - 1)


def token_stats(logits: torch.Tensor, token: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, 2): each sampled token's log-probability and the entropy of the distribution
    (``logits / temperature``; temperature 0 counts as 1), fp32."""
    logp = (logits.float() / (temperature or 1.0)).log_softmax(-1)
    entropy = -(logp.exp() * logp).nan_to_num().sum(-1)
    return torch.stack([logp.gather(-1, token[:, None]).squeeze(-1), entropy], -1)


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
             all_done: Callable[[bool], bool] | None = None,
             row_seeds: list[int] | None = None,
             stats: list[list[tuple[float, float]]] | None = None) -> list[list[int]]:
    """New tokens per prompt (a row stops after EOS, which it keeps). ``on_tokens(ids (B,),
    live (B,) bool)`` sees every step's tokens (those of finished rows are not live);
    ``loops`` is a looped model's loop count; ``vocab_size`` (the tokenizer's) keeps sampling
    off the padding rows of a model whose vocabulary was rounded up (``vocab_multiple``).
    ``until(row's new ids)`` stops a row when true (stop strings); ``all_done(this batch is
    done) -> every rank's is`` keeps data-parallel ranks stepping together (evaluation).
    ``row_seeds``: a generator per row (instead of ``sampling.seed``); ``stats``: an empty list
    that receives, per row, ``(log-probability, entropy)`` of each new token."""
    if not prompts or any(not p for p in prompts):
        raise ValueError("generate needs at least one non-empty prompt")
    if row_seeds is not None and len(row_seeds) != len(prompts):
        raise ValueError("generate: row_seeds needs one seed per prompt")
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
            out = []
            for i, p in enumerate(prompts):
                row_stats = [] if stats is not None else None
                out.append(generate(
                    model, [p], max_new_tokens=max_new_tokens, sampling=sampling, eos_id=eos_id,
                    use_cache=use_cache, loops=loops, pad_id=pad_id, vocab_size=vocab_size,
                    on_tokens=None, until=until, stats=row_stats,
                    row_seeds=None if row_seeds is None else [row_seeds[i]])[0])
                if stats is not None:
                    stats.extend(row_stats)
            return out
        step = lambda new: last_logits(model, torch.cat([ids, *new], 1), vocab_size,  # noqa: E731
                                       **kwargs)
        return _loop(step, ids, max_new_tokens, sampling, stops, on_tokens, row_seeds, stats)
    # A prompt repeated in the batch (an RL group's completions) is run once: its cache rows
    # are then shared by its rows' decode steps where they can be (``CacheSession.share``),
    # else copied to every row that repeats it.
    at = {}  # each distinct prompt's row in the first forward
    owner_rows = [at.setdefault(tuple(p), len(at)) for p in prompts]
    first_ids, first_valid = (ids, valid) if len(at) == len(prompts) else \
        _padded([list(p) for p in at], pad_id, device)
    owner = torch.tensor(owner_rows, device=device) if len(at) < len(prompts) else None
    with kv_cache.attach(model, len(at), ids.shape[1] + max_new_tokens, device) as session:
        def step(new: list[torch.Tensor]) -> torch.Tensor:
            session.begin(None if new else first_valid)  # None: one valid token per row
            logits = last_logits(model, first_ids if not new else new[-1], vocab_size, **kwargs)
            session.end()
            if not new and owner is not None:
                if not session.share(owner):
                    session.select(owner)
                logits = logits[owner]
            return logits  # (B, V)

        return _loop(step, ids, max_new_tokens, sampling, stops, on_tokens, row_seeds, stats)


def last_logits(model: nn.Module, ids: torch.Tensor, vocab_size: int | None,
                **kwargs) -> torch.Tensor:
    """The logits (B, V) of each row's last position, cut to the first ``vocab_size``: through
    the model's ``head=`` hook where it has one, so the head multiplies that one position by
    those rows only (a prompt's other positions, and a rounded-up vocabulary's padding rows,
    cost nothing: the prefill of a long prompt makes no (B, T, V) logits); else the whole
    logits, cut."""
    if takes_head(type(model)):
        return model(ids, head=_LastPosition(vocab_size), **kwargs)
    return model(ids, **kwargs)[:, -1, :vocab_size]


@functools.cache
def takes_head(cls: type) -> bool:
    """Whether a model class's forward takes a ``head=`` hook (kiln's do; a plugin's may not)."""
    return "head" in inspect.signature(cls.forward).parameters


class _LastPosition:
    """A ``head=`` hook: (B, T, D) hidden states -> (B, V) soft-capped logits of position T-1."""

    def __init__(self, vocab_size: int | None) -> None:
        self.vocab_size = vocab_size

    def __call__(self, hidden: torch.Tensor, weight: torch.Tensor, cap: float) -> torch.Tensor:
        return soft_cap(F.linear(hidden[:, -1], weight[:self.vocab_size]), cap)


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
          on_tokens, row_seeds: list[int] | None = None,
          stats: list | None = None) -> list[list[int]]:
    """Sample ``max_new_tokens`` steps; ``step(new_columns) -> logits (B, V)``."""
    generator = torch.Generator(ids.device).manual_seed(sampling.seed) if row_seeds is None \
        else [torch.Generator().manual_seed(s) for s in row_seeds]  # (CPU: one draw per row)
    done = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
    new: list[torch.Tensor] = []  # (B, 1) each
    out: list[list[int]] = [[] for _ in range(ids.shape[0])]
    if stats is not None:
        stats.extend([] for _ in range(ids.shape[0]))
        first = len(stats) - ids.shape[0]
    for _ in range(max_new_tokens):
        logits = step(new)
        token = sample(logits, sampling, generator)  # (B,)
        token = torch.where(done, torch.zeros_like(token), token)
        measured = token_stats(logits, token, sampling.temperature).tolist() \
            if stats is not None else None
        for i, (t, d) in enumerate(zip(token.tolist(), done.tolist(), strict=True)):
            if not d:
                out[i].append(t)
                if measured is not None:
                    stats[first + i].append(tuple(measured[i]))
        finished = stops.finished(done, token, out)
        if on_tokens is not None:
            on_tokens(token, ~done)
        done = finished
        new.append(token[:, None])
        if stops.batch_done(done):
            break
    return out

"""Scoring token sequences with a model: log-likelihoods of continuations, rolling windows and
greedy generation, one batch per call (the caller batches; every call makes a fixed number of
forwards, so data-parallel ranks stay in step under FSDP).

Continuations of one context share it: with a KV cache (``components/attention/kv_cache``) the
contexts run once, left-padded, the cache rows are repeated per choice, and one more forward runs
every choice's tokens after its own context. A model without a cache (or ``use_cache=False``:
compiled blocks, the reference path in tests) runs each context + continuation as its own
right-padded row, as lm-evaluation-harness's ``hf`` model does.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kiln.components import distributed
from kiln.components.attention import kv_cache
from kiln.components.models.lm_head import soft_cap

Group = tuple[list[int], list[list[int]]]  # a context's ids and its continuations' ids


class Scorer:
    """``model`` in eval mode under ``torch.no_grad``. Log-likelihoods are over the model's whole
    output (as lm-evaluation-harness computes them: rows of a rounded-up vocabulary keep their
    share of the probability); ``vocab_size`` (the tokenizer's) keeps greedy decoding on ids the
    tokenizer can decode. ``generate(model, prompts,
    max_new_tokens=, eos_id=, vocab_size=, pad_id=, loops=, until=, all_done=)`` is the greedy
    decoder (``components/models/generation.py``, passed in by the caller). With ``lockstep``
    (several ranks) generation runs until every rank's rows are done, so all make the same
    forwards."""

    def __init__(self, model: nn.Module, *, max_len: int, vocab_size: int,
                 autocast=None, use_cache: bool = True, generate: Callable | None = None,
                 lockstep: bool = False, loops: int | None = None, pad_id: int = 0) -> None:
        self.model = model
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.autocast = autocast or contextlib.nullcontext()
        self.use_cache = use_cache and kv_cache.supports_cache(model)
        self.generate_fn = generate
        self.lockstep = lockstep
        self.kwargs = {} if loops is None else {"loops": loops}
        self.loops = loops
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        # a model taking head= (docs/design.md) computes only the logits asked for
        self.head = "head" in inspect.signature(model.forward).parameters

    # ------------------------------------------------------------------------ log-likelihoods
    def _logprobs(self, ids: torch.Tensor, last: bool = False) -> torch.Tensor:
        """Log-probabilities (B, T, V), or (B, 1, V) of the last position only."""
        kwargs = {**self.kwargs, "head": _last_logits} if last and self.head else self.kwargs
        with self.autocast:
            logits = self.model(ids, **kwargs)  # (B, T, V) or (B, 1, V)
        if last:
            logits = logits[:, -1:]
        return logits.float().log_softmax(-1)

    @torch.no_grad()
    def loglikelihoods(self, groups: Sequence[Group]) -> list[list[tuple[float, bool]]]:
        """Per group, per continuation: (log-likelihood, whether greedy decoding gives it)."""
        if self.use_cache:
            return self._shared(groups)
        rows = [(ctx + cont, len(cont)) for ctx, conts in groups for cont in conts]
        flat = iter(self.score_rows(rows))
        return [[next(flat) for _ in conts] for _, conts in groups]

    @torch.no_grad()
    def score_rows(self, rows: Sequence[tuple[list[int], int]]) -> list[tuple[float, bool]]:
        """(ids, n): the log-likelihood of the last n ids given the ones before, one
        right-padded forward for all rows."""
        width = max(len(ids) for ids, _ in rows) - 1
        batch = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        for i, (ids, _) in enumerate(rows):
            batch[i, :len(ids) - 1] = torch.tensor(ids[:-1])
        logp = self._logprobs(batch.to(self.device))  # (R, W, V)
        out = []
        for i, (ids, n) in enumerate(rows):
            stop = len(ids) - 1
            target = torch.tensor(ids[-n:], device=self.device)
            out.append(_pick(logp[i, stop - n:stop], target))
        return out

    def _shared(self, groups: Sequence[Group]) -> list[list[tuple[float, bool]]]:
        contexts = [ctx for ctx, _ in groups]
        width = max(map(len, contexts))
        ids = torch.full((len(groups), width), self.pad_id, dtype=torch.long)
        valid = torch.zeros(len(groups), width, dtype=torch.bool)
        for i, ctx in enumerate(contexts):
            ids[i, width - len(ctx):] = torch.tensor(ctx)
            valid[i, width - len(ctx):] = True
        owner = [g for g, (_, conts) in enumerate(groups) for _ in conts]
        conts = [c for _, cs in groups for c in cs]
        tail = max(1, max(len(c) for c in conts) - 1)  # at least one column: a fixed 2 forwards
        new = torch.full((len(conts), tail), self.pad_id, dtype=torch.long)
        new_valid = torch.zeros(len(conts), tail, dtype=torch.bool)
        for r, c in enumerate(conts):
            new[r, :len(c) - 1] = torch.tensor(c[:-1], dtype=torch.long)
            new_valid[r, :len(c) - 1] = True
        dev = self.device
        with kv_cache.attach(self.model, len(groups), width + tail, dev) as session:
            session.begin(valid.to(dev))
            first = self._logprobs(ids.to(dev), last=True)[:, -1]  # (G, V): predicts the
            # first continuation token; the LM head runs on the last position only
            session.end()
            rows = torch.tensor(owner, device=dev)
            session.select(rows)
            session.begin(new_valid.to(dev))
            rest = self._logprobs(new.to(dev))  # (R, tail, V)
            session.end()
        first = first[rows]  # (R, V)
        flat = []
        for r, c in enumerate(conts):
            logp = torch.cat([first[r:r + 1], rest[r, :len(c) - 1]])  # (len(c), V)
            flat.append(_pick(logp, torch.tensor(c, device=dev)))
        it = iter(flat)
        return [[next(it) for _ in cs] for _, cs in groups]

    # ----------------------------------------------------------------------------- generation
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, stop: list[str],
                 decode: Callable[[list[int]], str], eos_id: int | None) -> list[list[int]]:
        """Greedy continuations (ids) of ``prompts``; a row stops at EOS, when its decoded text
        contains a ``stop`` string, or after ``max_new_tokens``."""
        if self.generate_fn is None:
            raise RuntimeError("this Scorer was built without a generate function")

        def until(ids: list[int]) -> bool:
            return bool(stop) and any(s in decode(ids) for s in stop)

        all_done = distributed.all_done if self.lockstep else None
        with self.autocast:
            return self.generate_fn(self.model, prompts, max_new_tokens=max_new_tokens,
                                    eos_id=eos_id, vocab_size=self.vocab_size,
                                    pad_id=self.pad_id, loops=self.loops, until=until,
                                    all_done=all_done, use_cache=self.use_cache)


def _last_logits(hidden: torch.Tensor, weight: torch.Tensor, cap: float) -> torch.Tensor:
    """The model's head on the last position only: (B, T, D) -> (B, 1, V)."""
    return soft_cap(F.linear(hidden[:, -1:], weight), cap)


def _pick(logp: torch.Tensor, target: torch.Tensor) -> tuple[float, bool]:
    """Sum of ``logp`` (n, V) at ``target`` (n,) and whether each target is the argmax."""
    ll = logp.gather(1, target[:, None]).sum()
    return float(ll), bool((logp.argmax(-1) == target).all())

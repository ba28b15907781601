"""Rollouts from kiln's own generator (``[training.step.rollout] type = "kiln"``): completions
sampled from the policy being trained, on its own model code, with the KV cache.

Each completion draws from its own seeded generator (``generation.generate``'s ``row_seeds``):
the caller derives the seed from the run's seed, the step, the prompt's stored row and the
sample's place in its group, so a completion is the same on 1 or 2 processes and after a
resume, whichever rows share its batch. Under FSDP2 every rank generates its own prompts, in
step with the others (a rank whose rows are done keeps stepping until all are).

The contract another engine (vLLM, SGLang) would implement, for GPUs: ``__call__`` gets the
policy (after the last optimizer step: an engine outside the process must load its weights
before sampling, e.g. a full ``state_dict`` gathered from the FSDP2 shards each step, or each
``sync_every`` steps with off-policy correction), the prompts' token ids and one seed per
completion, and returns each completion's ids, per-token log-probabilities and entropies under
the sampling temperature, and whether it stopped. The step recomputes the "old"
log-probabilities with its own training forward anyway (``grpo.py``), so an engine's numerics
never enter the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

from kiln.components import distributed
from kiln.components.base import ComponentConfig
from kiln.components.models import generation
from kiln.components.registry import register


class KilnRolloutConfig(ComponentConfig):
    temperature: float = Field(1.0, gt=0, description="sampling temperature (the training "
                               "log-probabilities divide the logits by it too, as TRL does)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling (1 = off)")
    top_k: int = Field(0, ge=0, description="sample among the k likeliest (0 = off)")
    max_new_tokens: int = Field(64, ge=1, description="most tokens per completion")
    stop: list[str] = Field(default_factory=list, description="stop strings besides the chat "
                            "template's end of turn (the completion's text is cut at the first)")
    batch_size: int = Field(0, ge=0, description="completions generated per forward batch "
                            "(0 = all of a rank's at once)")
    use_cache: bool = Field(True, description="sample with the KV cache")


@dataclass
class Sample:
    """One completion: its new ids (EOS kept), text cut at the first stop string, the token
    count the text came from, whether it ran out of ``max_new_tokens``, and per token the
    log-probability and entropy under the temperature's whole distribution (before ``top_p`` /
    ``top_k``, as the training forward computes them)."""

    ids: list[int]
    text: str
    truncated: bool
    logprobs: list[float]
    entropies: list[float]


@register("rollout", "kiln")
class KilnRollout:
    """Sampling with kiln's KV-cache generator, one seeded generator per completion."""

    Config = KilnRolloutConfig

    def __init__(self, cfg: KilnRolloutConfig) -> None:
        self.cfg = cfg
        self.sampling = generation.Sampling(temperature=cfg.temperature, top_k=cfg.top_k,
                                            top_p=cfg.top_p)

    @property
    def temperature(self) -> float:
        return self.cfg.temperature

    @property
    def max_new_tokens(self) -> int:
        return self.cfg.max_new_tokens

    @property
    def truncation(self) -> str:
        """How sampling cuts the temperature's distribution ("" when it does not)."""
        cuts = [f"top_p = {self.cfg.top_p:g}"] if self.cfg.top_p < 1 else []
        return ", ".join(cuts + ([f"top_k = {self.cfg.top_k}"] if self.cfg.top_k else []))

    @torch.no_grad()
    def __call__(self, model: torch.nn.Module, prompts: list[list[int]], seeds: list[int], *,
                 decode, stops: list[str], eos_id: int | None, pad_id: int,
                 vocab_size: int | None, lockstep: bool) -> list[Sample]:
        """A completion per prompt (repeat a prompt for a group), each drawn with its seed."""
        stops = [*stops, *self.cfg.stop]
        size = self.cfg.batch_size or len(prompts)
        out: list[Sample] = []
        was_training = model.training
        try:
            for start in range(0, len(prompts), size):
                part = slice(start, start + size)
                stats: list = []
                ids = generation.generate(
                    model, prompts[part], max_new_tokens=self.cfg.max_new_tokens,
                    sampling=self.sampling, eos_id=eos_id, use_cache=self.cfg.use_cache,
                    pad_id=pad_id, vocab_size=vocab_size, row_seeds=seeds[part], stats=stats,
                    until=lambda new: bool(stops) and any(s in decode(new) for s in stops),
                    all_done=distributed.all_done if lockstep else None)
                for row, row_stats in zip(ids, stats, strict=True):
                    text = decode(row)
                    cut = [text.index(s) for s in stops if s in text]
                    ended = bool(cut) or (eos_id is not None and bool(row) and row[-1] == eos_id)
                    out.append(Sample(row, text[:min(cut)] if cut else text,
                                      not ended and len(row) >= self.cfg.max_new_tokens,
                                      [lp for lp, _ in row_stats], [h for _, h in row_stats]))
        finally:
            model.train(was_training)
        return out

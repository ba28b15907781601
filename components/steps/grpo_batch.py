"""What the GRPO step does with a rollout before the loss: seeds per completion, rewards,
training rows (prompt + completion, the loss on the completion's tokens), the rollout log.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kiln.components.errors import DataError
from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.components.rewards.builtin import Completion


def completion_seed(seed: int, step: int, row: int, sample: int) -> int:
    """The sampling seed of completion ``sample`` of stored prompt ``row`` at ``step`` (0-based):
    the same whichever rank or batch generates it."""
    return int(np.random.SeedSequence([seed, 0x6290, step, row, sample]).generate_state(1)[0])


def refill_row(seed: int, step: int, slot: int, round_: int, count: int) -> int:
    """The stored row of the prompt replacing slot ``slot``'s group in refill round ``round_``
    (dynamic sampling): a function of the slot, not of the rank."""
    return int(np.random.default_rng([seed, 0x5EF, step, slot, round_]).integers(count))


def score(rewards: dict, weights: list[float], samples: list, fields: list[dict], group: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(each reward's values (N, K) in ``rewards``' order, the total weighted by ``weights``
    (N,)) of completions ``samples`` whose prompts' ``fields`` come ``group`` at a time."""
    completions = [Completion(s.text, len(s.ids), s.truncated, fields[i // group])
                   for i, s in enumerate(samples)]
    values = torch.tensor([_scores(name, reward, completions)
                           for name, reward in rewards.items()],
                          dtype=torch.float32).T.reshape(len(samples), len(rewards))
    return values, (values * torch.tensor(weights, dtype=torch.float32)).sum(1)


def _scores(name: str, reward, completions: list[Completion]) -> list[float]:
    """One reward's scores, a float per completion; what it cannot score stops the run with
    one line naming it (a gold answer that is not a number, a plugin's own error)."""
    try:
        scores = [float(x) for x in reward(completions)]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"rewards.{name}: {exc}") from None
    if len(scores) != len(completions):
        raise DataError(f"rewards.{name} gave {len(scores)} scores for {len(completions)} "
                        "completions (one float each)")
    return scores


@dataclass
class Rows:
    """Prompt + completion rows for the training forward, right-padded: ``batch`` holds
    ``input_ids``, ``labels`` (``IGNORE_INDEX`` but on completion tokens) and ``doc_ids``."""

    batch: dict[str, torch.Tensor]
    mask: torch.Tensor  # (B, T) the completion tokens the loss counts
    sampled: torch.Tensor  # (B, T) the generator's log-probability of each completion token

    def part(self, s: slice) -> Rows:
        return Rows({k: v[s] for k, v in self.batch.items()}, self.mask[s], self.sampled[s])


def training_rows(prompts: list[list[int]], samples: list, pad_id: int, device,
                  drop_truncated: bool = False) -> Rows:
    """The rows of completions ``samples`` (one prompt per sample); with ``drop_truncated``
    a completion cut by ``max_new_tokens`` counts no token (DAPO's overlong filtering)."""
    seqs = [p + s.ids for p, s in zip(prompts, samples, strict=True)]
    width = max(len(s) for s in seqs) - 1
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), IGNORE_INDEX, dtype=torch.long)
    sampled = torch.zeros(len(seqs), width)
    for r, (p, seq) in enumerate(zip(prompts, seqs, strict=True)):
        ids[r, :len(seq) - 1] = torch.tensor(seq[:-1])
        labels[r, len(p) - 1:len(seq) - 1] = torch.tensor(seq[len(p):])
        sampled[r, len(p) - 1:len(seq) - 1] = torch.tensor(samples[r].logprobs)
    mask = labels != IGNORE_INDEX
    if drop_truncated:
        mask &= ~torch.tensor([s.truncated for s in samples])[:, None]
    batch = {"input_ids": ids, "labels": labels, "doc_ids": torch.zeros_like(ids, dtype=torch.int)}
    return Rows({k: v.to(device) for k, v in batch.items()}, mask.to(device),
                sampled.to(device))


def write_log(path: Path, records: list[dict]) -> None:
    """The rollout log (JSON lines), written aside then renamed: a crash leaves the old file
    or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    os.replace(tmp, path)

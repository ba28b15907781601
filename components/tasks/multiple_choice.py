"""Multiple choice by log-likelihood (HellaSwag, ARC, PIQA, MMLU style).

Each choice is scored as ``log P(choice_prefix + choice | prompt)``; the metrics are those of
lm-evaluation-harness: ``acc`` (the likeliest choice is the answer), ``acc_norm`` (log-likelihood
divided by the choice's length in characters) and ``acc_bytes`` (by its length in UTF-8 bytes);
ties go to the first choice. The choices of an example share its prompt: one forward of the
prompt with a KV cache, then one of every choice (``Scorer``). A prompt too long for the model is
cut for each choice on its own, as the harness cuts it, so choices share the prompt only where
their cuts are the same.

JSONL schema: ``{"context": str, "choices": [str, ...], "answer": int}``; ``answer`` may also be
a label (with ``fields.labels``, e.g. ARC's ``choices.label``), a letter A.., a number as text or
the text of a choice. ``fields`` maps these names to a file's own (dotted paths; ``choices`` may
be a list of fields, as PIQA's ``["sol1", "sol2"]``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field

from kiln.components.errors import DataError
from kiln.components.registry import register
from kiln.components.tasks import common, task_files

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class MultipleChoiceConfig(common.TaskConfig):
    """A multiple-choice task scored by log-likelihood."""

    field_names: ClassVar[tuple[str, ...]] = ("context", "choices", "answer", "labels")

    template: str = Field("{context}", description="the prompt: {context}, {options} (the "
                          "choices listed as 'A. ...' lines) or any {field} of the file")
    choice_prefix: str = Field(" ", description="text between the prompt and each choice (the "
                               "harness's target_delimiter)")
    score_letters: bool = Field(False, description="score the option letters ' A', ' B', ... "
                                "instead of the choice texts (MMLU style, with {options})")
    markup: Literal["none", "wikihow"] = Field(
        "none", description="wikihow: HellaSwag's clean-up (' [title]' -> '. ', other [...] "
        "spans removed, double spaces collapsed) of prompt and choices")


@dataclass
class Example:
    groups: list[tuple[list[int], list[list[int]]]]  # (prompt ids, continuation ids) per group
    answer: int
    chars: list[int]
    nbytes: list[int]
    slots: list[int]  # the choice of each continuation, in the groups' order


def wikihow(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def answer_index(v: Any, choices: list[str], labels: list[str] | None, where: str) -> int:
    """The gold choice's index from an int, a label, a letter, a number as text or a choice."""
    idx = None
    if isinstance(v, int) and not isinstance(v, bool):
        idx = v
    elif isinstance(v, str):
        s = v.strip()
        if labels is not None and s in labels:
            idx = labels.index(s)
        elif s.lstrip("-").isdigit():
            idx = int(s)
        elif len(s) == 1 and s in LETTERS:
            idx = LETTERS.index(s)
        elif s in choices:
            idx = choices.index(s)
    if idx is None:
        raise DataError(f"{where}: answer {v!r} is not a choice index, label, letter or choice "
                        "text")
    if not 0 <= idx < len(choices):
        raise DataError(f"{where}: answer {v!r} is out of range: the example has "
                        f"{len(choices)} choices (0..{len(choices) - 1})")
    return idx


@register("task", "multiple_choice")
class MultipleChoice(common.Task):
    """Multiple choice by log-likelihood: acc, acc_norm (per character), acc_bytes."""

    Config = MultipleChoiceConfig
    columns = ["acc", "acc_norm", "acc_bytes"]
    headline = "acc"

    def _fields(self, row: dict, where: str) -> tuple[str, list[str], int]:
        cfg = self.cfg
        context = task_files.text(row, self.path_of("context"), where)
        spec = self.path_of("choices")
        if isinstance(spec, list):
            choices = [task_files.text(row, p, where) for p in spec]
        else:
            raw = task_files.value(row, spec, where)
            if not isinstance(raw, list) or not all(isinstance(c, str) for c in raw):
                raise DataError(f"{where}: field {spec!r} must be a list of texts, got "
                                f"{type(raw).__name__}")
            choices = list(raw)
        if len(choices) < 2:
            raise DataError(f"{where}: {len(choices)} choice(s); a multiple-choice example "
                            "needs at least 2")
        labels = None
        if "labels" in cfg.fields:
            labels = [str(x) for x in task_files.value(row, cfg.fields["labels"], where)]
        answer = answer_index(task_files.value(row, self.path_of("answer"), where), choices,
                              labels, where)
        if cfg.markup == "wikihow":
            context, choices = wikihow(context), [wikihow(c) for c in choices]
        return context, choices, answer

    def _prompt(self, row: dict, where: str) -> tuple[str, list[str], int]:
        """(prompt without shots, the scored choice texts, answer)."""
        context, choices, answer = self._fields(row, where)
        options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(choices))
        prompt = common.fill(self.cfg.template, {"context": context, "options": options}, row,
                             where)
        if self.cfg.score_letters:
            choices = list(LETTERS[:len(choices)])
        return prompt, choices, answer

    def _shot(self, row: dict, where: str) -> str:
        prompt, choices, answer = self._prompt(row, where)
        return prompt + self.cfg.choice_prefix + choices[answer]

    def plan(self, tokenizer, max_len: int) -> common.Plan:
        rows, label = self.rows()
        examples, sizes, truncated = [], [], 0
        for i, row in enumerate(rows):
            where = self.where(label, i)
            prompt, choices, answer = self._prompt(row, where)
            prompt = self.shots(i, self._shot) + prompt
            if any(c == "" for c in choices):
                raise DataError(f"{where}: an empty choice cannot be scored")
            pairs = [common.encode_pair(tokenizer, prompt, self.cfg.choice_prefix + c,
                                        bos=self.cfg.add_bos) for c in choices]
            longest = max(len(cont) for _, cont in pairs)
            if longest > max_len:
                raise DataError(f"{where}: a choice is {longest} tokens, longer than the "
                                f"model's context ({max_len})")
            # the harness's cut, per choice: context + choice keep their last max_len + 1 ids
            # (the last one is only predicted), so a shorter choice keeps more context; the
            # choices whose cut context is the same share it (one group)
            cuts = [common.left_truncate(ctx, max_len + 1 - len(cont)) for ctx, cont in pairs]
            shared: dict[tuple[int, ...], list[int]] = {}  # cut context -> its choices
            for choice, (ctx, _) in enumerate(cuts):
                shared.setdefault(tuple(ctx), []).append(choice)
            groups = [(list(ctx), [pairs[c][1] for c in owned]) for ctx, owned in shared.items()]
            examples.append(Example(groups, answer, [len(c) for c in choices],
                                    [len(c.encode("utf-8")) for c in choices],
                                    [c for owned in shared.values() for c in owned]))
            sizes.append(max(len(g[0]) for g in groups) + longest)
            truncated += any(cut for _, cut in cuts)
        return common.Plan(len(examples), list(self.columns), [
            common.Batch(b, [examples[u] for u in b])
            for b in common.batches(list(range(len(examples))), sizes, self.cfg.batch_size)
        ], truncated=truncated, examples=len(examples))

    def loglikelihoods(self, scorer, batch: common.Batch) -> list[list[float]]:
        """Per example of the batch, each choice's log-likelihood."""
        groups = [g for ex in batch.payload for g in ex.groups]
        scored = iter(scorer.loglikelihoods(groups))
        out = []
        for ex in batch.payload:
            flat = [ll for _ in ex.groups for ll, _ in next(scored)]
            lls = [0.0] * len(flat)
            for choice, ll in zip(ex.slots, flat, strict=True):
                lls[choice] = ll
            out.append(lls)
        return out

    def score(self, scorer, batch: common.Batch) -> torch.Tensor:
        rows = []
        for ex, lls in zip(batch.payload, self.loglikelihoods(scorer, batch), strict=True):
            lls = np.array(lls)
            rows.append([float(np.argmax(lls) == ex.answer),
                         float(np.argmax(lls / np.array(ex.chars, dtype=float)) == ex.answer),
                         float(np.argmax(lls / np.array(ex.nbytes, dtype=float)) == ex.answer)])
        return torch.tensor(rows, dtype=torch.float64)

    def summarize(self, values: torch.Tensor) -> dict[str, float]:
        return common.with_stderr(values, self.columns)

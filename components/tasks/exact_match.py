"""Generation with exact match (GSM8K style): greedy decoding with the KV cache until a stop
string, EOS or ``max_new_tokens``; the text is cut at the first stop string (as
lm-evaluation-harness's ``generate_until``), the answer extracted by ``extract_regex`` and compared
with the gold answer after the ``ignore`` regexes, case and punctuation rules.

JSONL schema: ``{"prompt": str, "answer": str}``; ``answer_regex`` pulls the gold answer out of a
longer answer field (GSM8K's worked solution ending in ``#### 42``), whose full text is what
few-shot examples show after their prompts.
"""

from __future__ import annotations

import inspect
import re
import string
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from pydantic import Field, field_validator

from kiln.components.base import regex
from kiln.components.errors import DataError
from kiln.components.registry import register
from kiln.components.tasks import common, task_files
from kiln.components.tokenizers import chat_templates as templates

INVALID = "[invalid]"  # the extraction of an output the regex does not match (as the harness)


class ExactMatchConfig(common.TaskConfig):
    """A generation task scored by exact match."""

    field_names: ClassVar[tuple[str, ...]] = ("prompt", "answer")

    template: str = Field("{prompt}", description="the prompt: {prompt} or any {field}")
    answer_prefix: str = Field(" ", description="text between a shot's prompt and its answer")
    answer_regex: str = Field("", description="gold answer = this regex's first group (or "
                              "match) in the answer field ('' = the whole field)")
    extract_regex: str = Field("", description="prediction = this regex's group (or match) in "
                               "the output ('' = the whole output)")
    extract: Literal["first", "last"] = Field("first", description="which extract_regex match")
    ignore: list[str] = Field(default_factory=list, description="regexes removed from the "
                              "prediction and the answer before comparing")
    ignore_case: bool = Field(False, description="compare case-insensitively")
    ignore_punctuation: bool = Field(False, description="drop ASCII punctuation before comparing")
    stop: list[str] = Field(default_factory=lambda: ["\n\n"],
                            description="stop strings: generation ends at the first")
    max_new_tokens: int = Field(128, ge=1, description="most tokens generated per example")
    chat_template: str = Field(
        "", description='render prompts as a conversation: "chatml", a .jinja file or a model '
        'folder ("" = plain text); shots become earlier user / assistant turns and the '
        "template's end of turn a stop string")

    @field_validator("answer_regex", "extract_regex")
    @classmethod
    def _compiles(cls, v: str) -> str:
        return regex(v)


@dataclass
class Example:
    prompt: list[int]
    gold: str


def _group(m: re.Match) -> str:
    return next((g for g in m.groups() if g is not None), "") if m.groups() else m.group(0)


@register("task", "exact_match")
class ExactMatch(common.Task):
    """Greedy generation, answer extracted by a regex, exact_match."""

    Config = ExactMatchConfig
    columns = ["exact_match"]
    headline = "exact_match"

    def _prompt(self, row: dict, where: str) -> tuple[str, str]:
        prompt_text = task_files.text(row, self.path_of("prompt"), where)
        answer = task_files.text(row, self.path_of("answer"), where)
        return common.fill(self.cfg.template, {"prompt": prompt_text}, row, where), answer

    def _shot(self, row: dict, where: str) -> str:
        prompt, answer = self._prompt(row, where)
        return prompt + self.cfg.answer_prefix + answer

    def gold(self, answer: str, where: str) -> str:
        if not self.cfg.answer_regex:
            return answer.strip()
        m = re.search(self.cfg.answer_regex, answer)
        if m is None:
            raise DataError(f"{where}: the answer {answer[-60:]!r} does not match answer_regex "
                            f"{self.cfg.answer_regex!r}")
        return _group(m).strip()

    def _chat_ids(self, template, i: int, prompt: str) -> list[int]:
        """The prompt as the last user turn after the shots' turns (lm-evaluation-harness's
        ``--apply_chat_template --fewshot_as_multiturn``)."""
        turns: list[dict[str, str]] = []

        def shot(row: dict, where: str) -> str:
            q, a = self._prompt(row, where)
            turns.extend([{"role": "user", "content": q},
                          {"role": "assistant", "content": self.gold(a, where)}])
            return ""

        self.shots(i, shot)
        return templates.prompt_ids(template, self.tokenizer,
                                    [*turns, {"role": "user", "content": prompt}])

    def plan(self, tokenizer, max_len: int) -> common.Plan:
        self.tokenizer = tokenizer
        template = templates.resolve(self.cfg.chat_template, tokenizer) \
            if self.cfg.chat_template else None
        self.stops = list(self.cfg.stop)
        if template is not None and (end := templates.end_of_turn(template)):
            self.stops.append(end)
        room = max_len - self.cfg.max_new_tokens
        if room < 1:
            raise DataError(f"task {self.name!r}: max_new_tokens = {self.cfg.max_new_tokens} "
                            f"leaves no room for a prompt in the model's context ({max_len})")
        rows, label = self.rows()
        examples, truncated = [], 0
        for i, row in enumerate(rows):
            where = self.where(label, i)
            prompt, answer = self._prompt(row, where)
            ids = self._chat_ids(template, i, prompt) if template is not None else \
                tokenizer.encode(self.shots(i, self._shot) + prompt, bos=self.cfg.add_bos,
                                 eos=False)
            ids, cut = common.left_truncate(ids, room)
            truncated += cut
            examples.append(Example(ids, self.gold(answer, where)))
        sizes = [len(e.prompt) for e in examples]
        return common.Plan(len(examples), list(self.columns), [
            common.Batch(b, [examples[u] for u in b])
            for b in common.batches(list(range(len(examples))), sizes, self.cfg.batch_size)
        ], truncated=truncated, examples=len(examples))

    def generations(self, scorer, batch: common.Batch) -> list[str]:
        """The batch's outputs, cut at the first stop string."""
        outs = scorer.generate([e.prompt for e in batch.payload],
                               max_new_tokens=self.cfg.max_new_tokens, stop=self.stops,
                               decode=self._decode, eos_id=self.tokenizer.eos_id)
        texts = []
        for ids in outs:
            text = self._decode(ids)
            for s in self.stops:
                text = text.split(s)[0]
            texts.append(text)
        return texts

    def _decode(self, ids) -> str:
        """Text of generated ids; with a chat template its special end-of-turn token kept, so
        the stop string can cut there."""
        if self.cfg.chat_template and "skip_special" in inspect.signature(
                self.tokenizer.decode).parameters:
            return self.tokenizer.decode(ids, skip_special=False)
        return self.tokenizer.decode(ids)

    def extract(self, text: str) -> str:
        if not self.cfg.extract_regex:
            return text.strip()
        found = list(re.finditer(self.cfg.extract_regex, text))
        if not found:
            return INVALID
        return _group(found[0] if self.cfg.extract == "first" else found[-1]).strip()

    def normalize(self, text: str) -> str:
        for pattern in self.cfg.ignore:
            text = re.sub(pattern, "", text)
        if self.cfg.ignore_case:
            text = text.lower()
        if self.cfg.ignore_punctuation:
            text = text.translate(str.maketrans("", "", string.punctuation))
        return text.strip()

    def score(self, scorer, batch: common.Batch) -> torch.Tensor:
        rows = [[float(self.normalize(self.extract(t)) == self.normalize(e.gold))]
                for t, e in zip(self.generations(scorer, batch), batch.payload, strict=True)]
        return torch.tensor(rows, dtype=torch.float64)

    def summarize(self, values: torch.Tensor) -> dict[str, float]:
        return common.with_stderr(values, self.columns)

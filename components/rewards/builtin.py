"""The rewards kiln ships (``[rewards.NAME] type = "..."``): each scores a batch of
completions from their text and the prompt's fields; none executes the model's text.

- ``exact_match``: the extracted answer (a regex's group, the last number, or the whole text)
  equals the prompt's ``field`` (1 or 0);
- ``numeric``: the extracted number is within ``tolerance`` of the field's (1 or 0);
- ``format``: the completion matches ``regex`` (1 or 0);
- ``length``: DAPO's soft overlong punishment (0 up to ``max_tokens - buffer`` tokens, then
  falling linearly to -1 at ``max_tokens`` and below beyond).

A plugin adds its own with ``@register("reward", "NAME")``: a class built from its config,
called ``reward(completions: list[Completion]) -> list[float]``, with ``fields`` (the prompt
fields it reads, checked against the data before step 1) and, optionally, ``check(fields)``
(raises ``ValueError`` for a prompt it cannot score; run on every prompt before step 1).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, field_validator

from kiln.components.base import ComponentConfig, regex
from kiln.components.registry import register

# A number as written in prose: thousands grouped by commas ("1,034") or plain digits, an
# optional fraction, or a bare fraction (".5"). A comma not followed by three digits ends the
# number, so a list "1,2,3" reads as three numbers, not 123.
NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?!\d)|-?\.\d+")


@dataclass(frozen=True)
class Completion:
    """What a reward sees of one completion: its text (cut at the first stop string), its
    token count, whether it hit ``max_new_tokens`` unfinished, and its prompt's fields."""

    text: str
    tokens: int
    truncated: bool
    fields: dict[str, Any] = field(default_factory=dict)


class RewardConfig(ComponentConfig):
    weight: float = Field(1.0, description="its weight in the reward the advantages are "
                          "computed from (each reward is logged unweighted on its own)")


class RegexChecked(RewardConfig):
    """A reward config whose ``regex`` must compile."""

    @field_validator("regex", check_fields=False)
    @classmethod
    def _compiles(cls, v: str) -> str:
        return regex(v)


class ExtractConfig(RegexChecked):
    field: str = Field("answer", description="the prompt's field holding the gold answer")
    extract: Literal["regex", "last_number", "all"] = Field(
        "regex", description='how the answer is read from the completion: "regex" (its first '
        'group, else the match), "last_number" (the last number in the text), "all" (the '
        "whole text, stripped)")
    regex: str = Field("", description='with extract = "regex": the pattern (searched)')
    occurrence: Literal["first", "last"] = Field("first", description="which regex match")


class ExactMatchConfig(ExtractConfig):
    ignore_case: bool = Field(False, description="compare case-insensitively")


class NumericConfig(ExtractConfig):
    extract: Literal["regex", "last_number", "all"] = Field(
        "last_number", description='how the number is read: "last_number", "regex" or "all"')
    tolerance: float = Field(1e-6, ge=0, description="largest absolute difference counted "
                             "equal")


class FormatConfig(RegexChecked):
    regex: str = Field(..., description="the pattern the completion must match")
    full: bool = Field(False, description="the whole completion must match (else anywhere)")


class LengthConfig(RewardConfig):
    max_tokens: int = Field(..., ge=1, description="the length punished fully (-1)")
    buffer: int = Field(..., ge=1, description="tokens before max_tokens where the punishment "
                        "rises linearly from 0")


class Extracting:
    """Reads the answer out of a completion."""

    fields: tuple[str, ...]

    def __init__(self, cfg: ExtractConfig) -> None:
        self.cfg, self.fields = cfg, (cfg.field,)
        if cfg.extract == "regex" and not cfg.regex:
            raise ValueError('extract = "regex" needs a regex (or extract = "last_number" / '
                             '"all")')

    def answer(self, text: str) -> str | None:
        c = self.cfg
        if c.extract == "all":
            return text.strip()
        if c.extract == "last_number":
            found = NUMBER.findall(text)
            return found[-1].replace(",", "") if found else None
        found = list(re.finditer(c.regex, text))
        if not found:
            return None
        m = found[0] if c.occurrence == "first" else found[-1]
        groups = [g for g in m.groups() if g is not None]
        return (groups[0] if groups else m.group(0)).strip()


@register("reward", "exact_match")
class ExactMatchReward(Extracting):
    """1 when the extracted answer equals the prompt's field, else 0."""

    Config = ExactMatchConfig

    def __call__(self, completions: list[Completion]) -> list[float]:
        def norm(s: str) -> str:
            if self.cfg.extract == "last_number":  # read without its thousands commas: the
                s = s.replace(",", "")  # gold too ("1,034" equals the answer 1034)
            return s.strip().lower() if self.cfg.ignore_case else s.strip()

        def equal(got: str, gold: Any) -> bool:
            # A number in the data is a number, not its repr: a float column (parquet, a
            # pandas export with gaps) holds 58 as 58.0, which "58" would never match as text.
            if isinstance(gold, int | float) and not isinstance(gold, bool) and \
                    (number := _number(got)) is not None:  # (the numeric reward's reading)
                return number == float(gold)
            return norm(got) == norm(str(gold))

        out = []
        for c in completions:
            got = self.answer(c.text)
            out.append(float(got is not None and equal(got, c.fields[self.cfg.field])))
        return out


@register("reward", "numeric")
class NumericReward(Extracting):
    """1 when the extracted number is within ``tolerance`` of the field's, else 0."""

    Config = NumericConfig

    def check(self, fields: dict[str, Any]) -> float:
        """The prompt's gold number; a prompt whose gold is not a number is refused (run on
        every prompt before step 1, so a bad row stops the run at its start, not at the step
        that samples it)."""
        gold = _number(str(fields[self.cfg.field]))
        if gold is None:
            raise ValueError(f"the prompt's {self.cfg.field!r} is not a number: "
                             f"{fields[self.cfg.field]!r}")
        return gold

    def __call__(self, completions: list[Completion]) -> list[float]:
        out = []
        for c in completions:
            got, gold = _number(self.answer(c.text)), self.check(c.fields)
            out.append(float(got is not None and abs(got - gold) <= self.cfg.tolerance))
        return out


def _number(text: str | None) -> float | None:
    try:
        value = float(text.replace(",", "")) if text is not None else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


@register("reward", "format")
class FormatReward:
    """1 when the completion matches ``regex``, else 0."""

    Config = FormatConfig
    fields: tuple[str, ...] = ()

    def __init__(self, cfg: FormatConfig) -> None:
        self.cfg, self.pattern = cfg, re.compile(cfg.regex)

    def __call__(self, completions: list[Completion]) -> list[float]:
        match = self.pattern.fullmatch if self.cfg.full else self.pattern.search
        return [float(match(c.text) is not None) for c in completions]


@register("reward", "length")
class LengthReward:
    """DAPO's soft overlong punishment: 0, then linearly down to -1 over the last ``buffer``
    tokens before ``max_tokens``, -1 beyond."""

    Config = LengthConfig
    fields: tuple[str, ...] = ()

    def __init__(self, cfg: LengthConfig) -> None:
        if cfg.buffer > cfg.max_tokens:
            raise ValueError("buffer must be at most max_tokens")
        self.cfg = cfg

    def __call__(self, completions: list[Completion]) -> list[float]:
        start = self.cfg.max_tokens - self.cfg.buffer
        return [0.0 if c.tokens <= start else
                max(-1.0, (start - c.tokens) / self.cfg.buffer) for c in completions]

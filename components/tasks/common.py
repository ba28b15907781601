"""What every task kind shares: its config (file, field map, preset, limit, few-shot, batch size,
when it runs in training), the plan of batches, prompt templates, few-shot sampling and the
context / continuation encoding lm-evaluation-harness uses.

A task (kind ``task``) is built as ``cfg.build(name=NAME)`` and offers
``plan(tokenizer, max_len) -> Plan`` (examples read, encoded and batched; deterministic, the
same on every rank), ``score(scorer, batch) -> Tensor (n, len(plan.columns))`` (per-unit values
of one batch) and ``summarize(values (units, columns)) -> dict[str, float]`` (the metrics).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, model_validator

from kiln.components.base import ComponentConfig
from kiln.components.errors import DataError
from kiln.components.tasks import presets, task_files

if TYPE_CHECKING:
    import torch


class TaskConfig(ComponentConfig):
    """Settings every task kind has."""

    # the kiln names a `fields` map may set for this kind (e.g. context, choices, answer)
    field_names: ClassVar[tuple[str, ...]] = ()

    path: str = Field("", description="examples: a .jsonl, .json or .parquet file, or "
                      "hf://datasets/owner/name[@revision]/FILE (Hub cache)")
    preset: str = Field("", description="a shipped field map and prompt format for a common "
                        "task's files (`kiln eval --list-tasks`); keys set here win")
    fields: dict[str, str | list[str]] = Field(
        default_factory=dict, description="kiln field name -> the file's field (dotted path, "
        "e.g. choices.text); unset names use the kiln name itself")
    limit: int = Field(0, ge=0, description="use the first N examples (0 = all)")
    num_fewshot: int = Field(0, ge=0, description="solved examples put before each prompt")
    fewshot_seed: int = Field(1234, description="seed of the few-shot draw (fixed per example)")
    fewshot_path: str = Field("", description="draw shots from this file (default: the task's "
                              "own examples, never the example itself)")
    fewshot_separator: str = Field("\n\n", description="text between shots and the prompt")
    batch_size: int = Field(16, ge=1, description="examples per forward batch")
    add_bos: bool = Field(True, description="start every prompt with the tokenizer's BOS")
    interval: int = Field(0, ge=0, description="in training: every N steps (0 = only at the "
                          "end, when at_end)")
    at_end: bool = Field(True, description="in training: also after the last step")
    mode: Literal["inline", "pause"] = Field(
        "inline", description="in training: inline = score in the loop; pause = save a "
        "snapshot and pending_downstream_eval.json, then exit 0 (a scheduler evaluates it)")

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("preset"):
            return data
        preset = presets.get(str(data["preset"]))
        if preset["type"] != data.get("type"):
            raise ValueError(f"preset {data['preset']!r} is a {preset['type']} task; set "
                             f"type = \"{preset['type']}\" or choose another preset")
        merged = {k: v for k, v in preset.items() if k not in ("type", "about", "fields")}
        fields = {**preset.get("fields", {}), **(data.get("fields") or {})}
        return {**merged, **data, "fields": fields}

    @model_validator(mode="after")
    def _known_fields(self) -> TaskConfig:
        unknown = sorted(set(self.fields) - set(self.field_names))
        if unknown:
            raise ValueError(f"fields: unknown name(s) {', '.join(unknown)} for a {self.type} "
                             f"task; valid: {', '.join(self.field_names)}")
        return self


@dataclass
class Batch:
    units: list[int]  # the rows of the values table this batch fills
    payload: Any  # what the task's score() reads


@dataclass
class Plan:
    units: int  # rows of the values table (examples, or windows for bits per byte)
    columns: list[str]  # per-unit values score() returns
    batches: list[Batch]
    truncated: int = 0  # examples cut from the left to fit the model's context
    examples: int = 0
    notes: list[str] = field(default_factory=list)


class Task:
    """Base of the built-in kinds: the examples, their fields and few-shot shots."""

    # the metric that stands for the task in `kiln compare` ("" = the first of summarize())
    headline: ClassVar[str] = ""

    def __init__(self, cfg: TaskConfig, *, name: str = "task") -> None:
        self.cfg = cfg
        self.name = name
        self._rows: tuple[list[dict], str] | None = None
        self._pool: tuple[list[dict], str] | None = None

    def rows(self) -> tuple[list[dict[str, Any]], str]:
        """The first ``limit`` examples of the task file and its name."""
        if self._rows is None:
            rows, label = task_files.read_rows(self.cfg.path, self.name)
            self._rows = (rows[:self.cfg.limit] if self.cfg.limit else rows), label
        return self._rows

    def fingerprint(self) -> str:
        """What the task scores: its examples and every setting that changes a score (not
        when it runs, nor its batch size). Runs with the same fingerprint scored the same
        examples, so their scores can be compared example by example."""
        rows, _ = self.rows()
        settings = self.cfg.model_dump(mode="json", exclude={"interval", "at_end", "mode",
                                                             "batch_size"})
        text = json.dumps([type(self).__name__, settings, rows], sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def where(self, label: str, index: int) -> str:
        return f"task {self.name!r}: {label}: {task_files.example(index)}"

    def path_of(self, name: str) -> str | list[str]:
        return self.cfg.fields.get(name, name)

    def shots(self, index: int, render) -> str:
        """The few-shot prefix of example ``index``: ``render(row, where)`` per drawn shot."""
        k = self.cfg.num_fewshot
        if not k:
            return ""
        own = not self.cfg.fewshot_path
        if self._pool is None:  # the whole file, not only the first `limit` examples
            self._pool = task_files.read_rows(self.cfg.fewshot_path or self.cfg.path, self.name)
        pool, label = self._pool
        candidates = [i for i in range(len(pool)) if not (own and i == index)]
        if len(candidates) < k:
            raise DataError(f"task {self.name!r}: num_fewshot = {k} but {label} has only "
                            f"{len(candidates)} other examples to draw from")
        picked = random.Random(f"{self.cfg.fewshot_seed}/{index}").sample(candidates, k)
        sep = self.cfg.fewshot_separator
        return "".join(render(pool[i], self.where(label, i)) + sep for i in picked)


_PLACEHOLDER = re.compile(r"\{([A-Za-z0-9_.\-]+)\}")


def fill(template: str, names: dict[str, str], row: dict[str, Any], where: str) -> str:
    """``template`` with each ``{name}`` replaced: a kiln field of ``names`` first, else the
    row's field at that dotted path; ``{{`` and ``}}`` stand for braces."""
    parts = template.replace("{{", "\0").replace("}}", "\1")

    def one(m: re.Match) -> str:
        key = m.group(1)
        return names[key] if key in names else task_files.text(row, key, where)

    return _PLACEHOLDER.sub(one, parts).replace("\0", "{").replace("\1", "}")


def encode_pair(tokenizer, context: str, continuation: str, *, bos: bool
                ) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-evaluation-harness splits them: trailing spaces of
    the context move to the continuation, the whole text is encoded and the continuation is
    what follows the context's own ids; an empty context becomes the BOS (else EOS) token."""
    if context == "":
        prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        cont = tokenizer.encode(continuation, bos=False, eos=False)
        return ([prefix], cont) if not cont or cont[0] != prefix else (cont[:1], cont[1:])
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation, bos=bos, eos=False)
    ctx = tokenizer.encode(context, bos=bos, eos=False)
    return ctx, whole[len(ctx):]


def batches(units: list[int], sizes: list[int], batch_size: int) -> list[list[int]]:
    """``units`` sorted longest first (ties by index), cut into batches: similar lengths share
    a batch, so little padding; the order is the same on every rank."""
    order = sorted(units, key=lambda u: (-sizes[u], u))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


STDERR = "_stderr"  # suffix of a metric's standard error, as lm-evaluation-harness names it


def mean_stderr(column: torch.Tensor) -> float:
    """Standard error of a per-example mean: the sample standard deviation (n - 1) over
    sqrt(n), lm-evaluation-harness's ``mean_stderr``; NaN (unknown) for fewer than two
    examples (logged as "nan": no comparison is judged on it)."""
    n = column.numel()
    return float(column.double().std(correction=1) / math.sqrt(n)) if n > 1 else math.nan


def with_stderr(values: torch.Tensor, columns: list[str]) -> dict[str, float]:
    """Each column's mean over the examples and its standard error (``<column>_stderr``)."""
    out = {}
    for i, c in enumerate(columns):
        out[c] = float(values[:, i].mean())
        out[c + STDERR] = mean_stderr(values[:, i])
    return out


def left_truncate(ids: list[int], room: int) -> tuple[list[int], bool]:
    """The last ``room`` ids and whether any were cut."""
    return (ids[-room:], True) if len(ids) > room else (ids, False)

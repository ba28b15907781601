"""The ``mixture`` dataset: named sources with weights, in stages, each source's share exact.

Each source is a dataset kiln reads by row (today ``packed_documents``: a `kiln data prepare`
folder, this machine's standard library, or a folder of text / JSONL / parquet files), built
with the recipe's tokenizer and ``seq_len``. Which source global training sequence ``j`` comes
from is ``mixture.order``'s pure function of (seed, the stage's weights, ``j`` counted from the
stage's start), so every number of processes and every micro-batch split sees the same global
batches, and every window of 1,000 sequences holds each source's share to within 1%. A source
gives its rows in order (row ``k``: window ``k mod W`` of data epoch ``k div W``, its ``W``
windows per epoch in that epoch's shuffled document order), continuing across stages.

``stages`` change the weights at given steps (an anneal on high-quality data at the end of a
run); each stage starts its own order. ``max_epochs`` caps how often a small source repeats:
the trainer checks the whole run before step 1 (``check_run``), and the loader refuses a row
past the cap (or, with ``on_exhausted = "repeat"``, the check only warns).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import Field

from kiln.components import registry
from kiln.components.base import ComponentConfig, Config, Sub
from kiln.components.data.mixture import order as mixture_order
from kiln.components.data.mixture.loader import MixtureLoader
from kiln.components.errors import DataError, KilnError, RecipeError
from kiln.components.protocols import DatasetContract, complete_dataset
from kiln.components.registry import register

_EXACT_LIMIT = 1 << 27  # sequences: beyond, the run plan estimates counts (see _counts)


class MixtureStage(Config):
    """From global step ``step`` (or ``fraction`` of the run) on, train on these weights."""

    step: int = Field(0, ge=0, description="steps taken before this stage begins (0-based step "
                      "of its first batch); or give fraction")
    fraction: float = Field(0.0, ge=0, lt=1, description="where the stage begins as a share "
                            "of training.steps (floor(fraction x steps), at least 1): it moves "
                            "with the run's length; or give step")
    weights: dict[str, float] = Field(
        description="share of each source in this stage (normalised); a source left out gives "
        "nothing in this stage")


class MixtureConfig(ComponentConfig):
    """Weighted sources, optionally in stages (docs/data.md "Mixtures and stages")."""

    sources: dict[str, Sub("dataset")] = Field(
        default_factory=dict, description="the sources by name: each a dataset table "
        "(type = \"packed_documents\" and its settings)")
    weights: dict[str, float] = Field(
        default_factory=dict, description="share of training sequences per source for the "
        "first stage (normalised; a source left out gives nothing until a stage names it); "
        "{} = equal shares")
    stages: list[MixtureStage] = Field(
        default_factory=list, description="later stages: [[data.stages]] step = N, weights = "
        "{...}; steps increasing, below training.steps")
    max_epochs: dict[str, float] = Field(
        default_factory=dict, description="most passes over a source's train split in the "
        "whole run, per source (absent = no cap)")
    on_exhausted: Literal["error", "repeat"] = Field(
        "error", description="a source needing more than max_epochs: stop before step 1 "
        "(error) or warn and repeat it")


@dataclass(frozen=True)
class Stage:
    index: int
    step: int  # its first global step
    weights: tuple[float, ...]  # normalised, in source order
    spec: int = 0  # 1 + its index in data.stages (0: the first stage, data.weights)


@register("dataset", "mixture")
class Mixture(DatasetContract):
    """Named sources with weights (and stages); each source's share exact in every window."""

    Config = MixtureConfig

    def __init__(self, cfg: MixtureConfig, *, tokenizer: Any, seq_len: int, seed: int = 0,
                 **context: Any) -> None:
        self.cfg, self.tokenizer, self.seq_len, self.seed = cfg, tokenizer, seq_len, seed
        if not cfg.sources:
            raise RecipeError("data.type = \"mixture\" needs sources: [data.sources.NAME] "
                              "tables, each a dataset (type = \"packed_documents\", ...)")
        self.names = sorted(cfg.sources)
        self.notes: list[str] = []  # weights rescaled to shares: said at the run's start
        self._specs = _stages(cfg, self.names, self.notes)
        # stages placed by fraction need the run's length: ``check_run`` places them
        self.stages: list[Stage] = [] if any(f for _, f, _ in self._specs) else \
            _place(self._specs, 0)[0]
        self.children: dict[str, Any] = {}
        for name in self.names:
            sub = cfg.sources[name]
            if not callable(getattr(registry.for_config(sub).obj, "rows", None)):
                raise RecipeError(
                    f"data.sources.{name}: a {sub.type!r} dataset cannot be a mixture source "
                    "yet (it has no access to rows by number); build it into a folder with "
                    "`kiln data prepare` and use type = \"packed_documents\" with path = that "
                    "folder")
            try:
                self.children[name] = complete_dataset(sub.build(  # (a plugin source too)
                    tokenizer=tokenizer, seq_len=seq_len, seed=seed, **context))
            except KilnError as exc:
                raise type(exc)(f"data.sources.{name}: {exc}") from None
        self._readers: dict[tuple[str, str], Any] = {}

    # ------------------------------------------------------------------ the dataset protocol
    @property
    def source_names(self) -> list[str]:
        """The sources in the order of a batch's ``source_ids`` (sorted names). The trainer
        logs per-source loss, tokens and evaluations for a dataset that has this."""
        return self.names

    def prepare(self, *, create: bool = False) -> Path | None:
        """Prepare every source (building cache entries) and check each holds a sequence."""
        for name in self.names:
            try:
                self.children[name].prepare(create=create)
            except KilnError as exc:
                raise type(exc)(f"data.sources.{name}: {exc}") from None
            if self.windows(name, "train") < 1:
                raise DataError(f"data.sources.{name}: its train split holds fewer than "
                                f"seq_len + 1 = {self.seq_len + 1} tokens; give it more text "
                                "or remove it")
        return None

    def fingerprints(self) -> dict[str, str]:
        """Each source's data (``data.sources.NAME``), for the resume check."""
        return self._by_source(lambda child: child.fingerprints())

    def eval_fingerprints(self) -> dict[str, str]:
        """Each source's held-out split (``data.sources.NAME``)."""
        return self._by_source(lambda child: child.eval_fingerprints())

    def _by_source(self, of) -> dict[str, str]:
        out = {}
        for name in self.names:
            out.update({f"data.sources.{name}{key.removeprefix('data')}": value
                        for key, value in of(self.children[name]).items()})
        return out

    @property
    def meta(self) -> dict[str, Any]:
        return {"sources": {n: dict(self.children[n].meta) for n in self.names}}

    def reader(self, name: str, split: str) -> Any:
        """Source ``name``'s row reader of ``split`` (``packed_loader.Windows``, ``ShardRows``)."""
        key = (name, split)
        if key not in self._readers:
            self._readers[key] = self.children[name].rows(split)
        return self._readers[key]

    def windows(self, name: str, split: str) -> int:
        """seq_len windows in one data epoch of source ``name``'s ``split``."""
        return self.reader(name, split).rows_per_epoch()

    def tokens_per_byte(self, split: str = "eval", source: str | None = None) -> float | None:
        """Of one source (``source``), or None: ``bits_per_byte`` of a mixture is per source."""
        if source is None:
            return None
        return self.children[source].tokens_per_byte(split)

    def loader(self, split: str, *, micro_batch: int, global_batch: int, rank: int = 0,
               world_size: int = 1, source: str | None = None) -> Any:
        """Rank ``rank``'s micro-batches of ``split``; for "eval", of one source's held-out
        rows (``source``) or of every source's in turn (None). See ``MixtureLoader``."""
        if source is not None and source not in self.children:
            raise RecipeError(f"no mixture source {source!r}; sources: {', '.join(self.names)}")
        return MixtureLoader(self, split, micro_batch=micro_batch, global_batch=global_batch,
                             rank=rank, world_size=world_size, source=source)

    # ------------------------------------------------------------------------- the schedule
    def stage_of(self, step: int) -> Stage:
        """The stage global step ``step`` (0-based) trains in."""
        if not self.stages:
            raise RecipeError("data.stages placed by fraction need the run's length: call "
                              "check_run(total_steps, global_batch) first (the trainer does)")
        current = self.stages[0]
        for s in self.stages:
            if s.step <= step:
                current = s
        return current

    def counts_before(self, step: int, global_batch: int) -> np.ndarray:
        """Sequences each source gave before global step ``step`` (all stages, all ranks)."""
        out = np.zeros(len(self.names), dtype=np.int64)
        for s, nxt in zip(self.stages, [*self.stages[1:], None], strict=True):
            end = step if nxt is None else min(step, nxt.step)
            if end <= s.step:
                break
            out += _counts(0, (end - s.step) * global_batch, s, self.seed)
        return out

    def step_counts(self, step: int, global_batch: int) -> np.ndarray:
        """Sequences each source gives in global step ``step``."""
        s = self.stage_of(step)
        start = (step - s.step) * global_batch
        return mixture_order.counts(start, start + global_batch, s.weights, self.seed, s.index)

    def check_run(self, total_steps: int, global_batch: int) -> list[str]:
        """Before step 1: stage steps below ``total_steps`` and every source within its
        ``max_epochs``; a DataError, or lines for the log: (``on_exhausted = "repeat"``) a
        warning per source past its cap, a note per source no stage trains on (eval only)."""
        self.stages, warnings = _place(self._specs, total_steps)
        warnings = [*self.notes, *warnings]
        warnings += [f"data: {n} is evaluated only (no weight in any stage)"
                    for i, n in enumerate(self.names) if not any(s.weights[i] for s in self.stages)]
        for line in self.plan(total_steps, global_batch):
            cap = self.cfg.max_epochs.get(line["source"])
            if line["stage"] is None and cap is not None and line["epochs"] > cap:
                what = (f"data.sources.{line['source']}: the run reads it {line['epochs']:.2f} "
                        f"times, above data.max_epochs.{line['source']} = {cap:g}")
                if self.cfg.on_exhausted == "error":
                    raise DataError(f"{what}; lower its weight, give it more data, raise the "
                                    "cap, or set data.on_exhausted = \"repeat\"")
                warnings.append(f"warning: {what}; repeating it (data.on_exhausted = repeat)")
        return warnings

    def stage_steps(self) -> list[int | None]:
        """Where each ``data.stages`` entry begins in this run (None: it does not run); saved
        with every checkpoint, so a resume with another ``training.steps`` keeps them
        (``pin_stages``)."""
        placed = {s.spec: s.step for s in self.stages}
        return [placed.get(i + 1) for i in range(len(self._specs) - 1)]

    def pin_stages(self, saved: list[int | None], resume_step: int,
                   total_steps: int) -> list[str]:
        """On a resume whose run length changed: a stage placed by fraction that began at or
        before ``resume_step`` stays where the run began it; one still to come moves with the
        new length, unless that puts it at or before ``resume_step`` (it would never run:
        refused). Lines for the log."""
        now = self.stage_steps()
        if saved == now or len(saved) != len(now):  # (other stages: a refused recipe change)
            return []
        specs, lines = list(self._specs), []
        for i, (was, new) in enumerate(zip(saved, now, strict=True)):
            where = f"data.stages[{i}] (fraction {self._specs[i + 1][1]:g})"
            if was == new:
                continue
            if was is not None and was <= resume_step:
                specs[i + 1] = (was, 0.0, specs[i + 1][2])
                lines.append(f"data: {where} stays at step {was}, where this run began it "
                             f"(in {total_steps} steps it would begin at step {new})")
            elif new is not None and new <= resume_step:
                raise DataError(
                    f"{where} would now begin at step {new}, at or before the resume step "
                    f"{resume_step}, where it had not begun (the checkpoint's run placed it at "
                    f"step {was}): it would never run; keep training.steps, or place it with "
                    "step = N")
            else:
                now_at = f"now begins at step {new}" if new is not None else "does not run"
                lines.append(f"data: {where} {now_at} in {total_steps} steps (was {was})")
        self.stages, _ = _place(specs, total_steps)
        return lines

    def plan(self, total_steps: int, global_batch: int) -> list[dict[str, Any]]:
        """Per source and stage (and the whole run, ``stage`` None): sequences, tokens, share
        and the epochs of its train split they imply (``kiln data mix`` prints this)."""
        out = []
        whole = np.zeros(len(self.names), dtype=np.int64)
        ends = [s.step for s in self.stages[1:]] + [total_steps]
        for s, end in zip(self.stages, ends, strict=True):
            n = max(0, min(end, total_steps) - s.step) * global_batch
            c = _counts(0, n, s, self.seed)
            whole += c
            out += self._lines(s.index, (s.step, end), c, whole, n)
        return out + self._lines(None, (0, total_steps), whole, whole,
                                 total_steps * global_batch)

    def _lines(self, stage: int | None, steps: tuple[int, int], c: np.ndarray,
               so_far: np.ndarray, n: int) -> list[dict[str, Any]]:
        return [{"stage": stage, "steps": steps, "source": name, "sequences": int(c[i]),
                 "tokens": int(c[i]) * self.seq_len, "share": c[i] / n if n else 0.0,
                 "epochs": int(so_far[i]) / self.windows(name, "train")}
                for i, name in enumerate(self.names)]

    def row_cap(self, name: str) -> int | None:
        """Train rows of ``name`` the loader may read (None: no cap, or repeating allowed)."""
        cap = self.cfg.max_epochs.get(name)
        if cap is None or self.cfg.on_exhausted == "repeat":
            return None
        return math.ceil(cap * self.windows(name, "train"))


def _counts(start: int, stop: int, stage: Stage, seed: int) -> np.ndarray:
    """Exact up to ``_EXACT_LIMIT`` sequences; beyond, the weights times the span (a Kronecker
    order's counts are within a few sequences of that), for the run plan only."""
    if stop - start <= _EXACT_LIMIT:
        return mixture_order.counts(start, stop, stage.weights, seed, stage.index)
    return np.round(np.asarray(stage.weights) * (stop - start)).astype(np.int64)


def _weights(table: dict[str, float], names: list[str], where: str,
             notes: list[str]) -> tuple[float, ...]:
    """The shares of ``names`` (sorted) a weights table gives; a line in ``notes`` when the
    weights do not sum to 1 (they are rescaled, as shares)."""
    unknown = sorted(set(table) - set(names))
    if unknown:
        raise RecipeError(f"{where} names unknown source(s) {', '.join(unknown)}; sources: "
                          f"{', '.join(names)}")
    for name, w in table.items():
        if not (math.isfinite(w) and w > 0):
            raise RecipeError(f"{where}.{name} = {w}: a weight must be a finite number > 0 "
                              "(leave a source out of a stage to skip it)")
    total = sum(table.values())
    shares = tuple(table.get(n, 0.0) / total for n in names)
    if not math.isclose(total, 1.0, rel_tol=1e-6):
        notes.append(f"data: {where} sum to {total:g}, not 1: used as shares "
                      + ", ".join(f"{n} {w:.4g}" for n, w in zip(names, shares, strict=True)
                                  if w))
    return shares


_Spec = tuple[int, float, tuple[float, ...]]  # (step, fraction, weights) of one stage


def _stages(cfg: MixtureConfig, names: list[str], notes: list[str]) -> list[_Spec]:
    first = _weights(cfg.weights, names, "data.weights", notes) if cfg.weights else \
        tuple(1.0 / len(names) for _ in names)  # no weights: equal shares
    out: list[_Spec] = [(0, 0.0, first)]
    for i, s in enumerate(cfg.stages):
        if (s.step > 0) == (s.fraction > 0):
            raise RecipeError(f"data.stages[{i}]: give step (>= 1) or fraction (0 < f < 1), "
                              f"one of them; got step = {s.step}, fraction = {s.fraction}")
        if not s.weights:
            raise RecipeError(f"data.stages[{i}].weights is empty: give at least one source a "
                              "weight > 0")
        out.append((s.step, s.fraction, _weights(s.weights, names, f"data.stages[{i}].weights",
                                                  notes)))
    for name in cfg.max_epochs:
        if name not in names:
            raise RecipeError(f"data.max_epochs names unknown source {name!r}; sources: "
                              f"{', '.join(names)}")
        if not cfg.max_epochs[name] > 0:
            raise RecipeError(f"data.max_epochs.{name} = {cfg.max_epochs[name]} must be > 0")
    return out


def _place(specs: list[_Spec], total_steps: int) -> tuple[list[Stage], list[str]]:
    """The stages at their steps (``total_steps``: the run's length; 0 = not known, only steps
    given), and warning lines for stages placed by fraction that fall outside a short run."""
    out, notes = [Stage(0, 0, specs[0][2])], []
    for i, (step, fraction, weights) in enumerate(specs[1:]):
        where = f"data.stages[{i}]"
        if fraction:
            step = max(1, math.floor(fraction * total_steps))
            if step >= total_steps or step <= out[-1].step:
                notes.append(f"warning: {where} (fraction {fraction:g}) falls at step {step} of "
                             f"a {total_steps}-step run: it does not run")
                continue
        elif total_steps and step >= total_steps:
            raise RecipeError(f"{where}.step = {step} is not below training.steps = "
                              f"{total_steps}: that stage would never run; lower its step, "
                              "raise training.steps, or place it by fraction")
        if step <= out[-1].step:
            raise RecipeError(f"{where} begins at step {step}, not after the stage before it "
                              f"(step {out[-1].step}): stages run in increasing step order")
        out.append(Stage(len(out), step, weights, spec=i + 1))
    return out, notes

"""Which run is best in a column, and which of the others are within noise of it.

For ``kiln compare`` and the sweep summary: the held-out loss and each downstream task's
headline score are judged (training losses carry no error bars). In each column the best run
is the lowest loss or bits per byte, the highest accuracy; every other run is tested against it
(``significance``): paired on the per-example scores both runs kept when they scored the same
examples (the same fingerprint), else a z-test on the standard errors. Runs whose held-out
sets differ (fingerprints) are not judged against each other: the column says so instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.recipes.runs import significance, unit_scores
from kiln.recipes.runs.read import Run
from kiln.recipes.runs.significance import Verdict

LOWER_IS_BETTER = ("bits_per_byte", "loss", "nll", "perplexity")


@dataclass
class Judgment:
    column: str  # "eval_loss" or "task/<name>"
    label: str  # for sentences: "eval loss", "python_mc acc"
    best: int | None = None  # row index
    verdicts: dict[int, Verdict] = field(default_factory=dict)  # row -> its test against best
    note: str = ""  # why the column is not judged (held-out sets differ), or ""
    lower: bool = True  # lower values are better (a loss), else higher (an accuracy)

    def mark(self, i: int) -> str:
        """"*" for the best, "~" within noise of it, "" beyond noise or not judged (no
        standard errors to judge by)."""
        if self.note or self.best is None or not self.verdicts:
            return ""
        if i == self.best:
            return "*"
        verdict = self.verdicts.get(i)
        return "~" if verdict is not None and not verdict.significant else ""


@dataclass
class _Entry:
    row: int
    value: float
    stderr: float | None
    fingerprint: str | None
    units: np.ndarray | None  # per-example (or per-batch) scores, when the run kept them


def judge(runs: list[Run], rows: list[dict[str, Any]]) -> list[Judgment]:
    """A judgment per column with error bars (rows: ``summary`` of each run, in order)."""
    out = []
    if any(r.get("eval_loss") is not None for r in rows):
        entries = [_Entry(i, r["eval_loss"], r["eval_info"].get("stderr"),
                          r["eval_info"].get("fingerprint"), _loss_units(runs[i], r))
                   for i, r in enumerate(rows) if r.get("eval_loss") is not None]
        out.append(_judge("eval_loss", "eval loss", entries, lower=True))
    names = sorted({n for r in rows for n in r.get("task_info", {})})
    for name in names:
        entries, metric = [], ""
        for i, r in enumerate(rows):
            info = r.get("task_info", {}).get(name)
            if info is None:
                continue
            metric = info["metric"]
            entries.append(_Entry(i, info["value"], info["stderr"], info["fingerprint"],
                                  _task_units(runs[i], name, info)))
        lower = any(word in metric for word in LOWER_IS_BETTER)
        out.append(_judge(f"task/{name}", f"{name} {metric}", entries, lower=lower))
    return out


def _judge(column: str, label: str, entries: list[_Entry], *, lower: bool) -> Judgment:
    judgment = Judgment(column, label, lower=lower)
    if len(entries) < 2:
        return judgment
    prints = {e.fingerprint for e in entries if e.fingerprint is not None}
    if len(prints) > 1:
        judgment.note = (f"{label}: the runs were scored on different data (fingerprints "
                         f"{', '.join(sorted(prints))}), so their values do not compare")
        return judgment
    best = min(entries, key=lambda e: e.value if lower else -e.value)
    judgment.best = best.row
    for e in entries:
        if e is best:
            continue
        verdict = None
        if (e.units is not None and best.units is not None and e.fingerprint is not None
                and e.fingerprint == best.fingerprint):
            verdict = significance.paired(e.units, best.units)
        if verdict is None and e.stderr is not None and best.stderr is not None:
            verdict = significance.unpaired(e.value, e.stderr, best.value, best.stderr)
        if verdict is not None:
            judgment.verdicts[e.row] = verdict
    return judgment


def _loss_units(run: Run, row: dict[str, Any]) -> np.ndarray | None:
    info = row.get("eval_info", {})
    if info.get("step") is None:
        return None
    got = unit_scores.load(run.folder, unit_scores.LOSS, info["step"], task=False)
    return significance.batch_means(got[0]) if got is not None else None


def _task_units(run: Run, name: str, info: dict[str, Any]) -> np.ndarray | None:
    got = unit_scores.load(run.folder, name, info["step"])
    if got is None:
        return None
    values, columns = got
    return values[:, columns.index(info["metric"]) if info["metric"] in columns else 0]


def unfinished(rows: list[dict[str, Any]]) -> list[str]:
    """A note per run that has not reached its last step (in progress, stopped or failed):
    its figures, judged ones included, are from an earlier step than the others' may be."""
    return [f"{r['run']}: not finished (logged up to step {r['steps']:,} of "
            f"{r['total_steps']:,}), so its figures are not its final ones" for r in rows
            if r.get("total_steps") is not None and r.get("steps", 0) < r["total_steps"]]


def sentence(judgment: Judgment, labels: list[str], noun: str = "run") -> str:
    """One line: which run (``noun``) wins the column, or that none does beyond noise (the
    sweep's)."""
    if judgment.note:
        return f"no verdict on {judgment.note}"
    if judgment.best is None:
        return f"no verdict on {judgment.label}: fewer than two {noun}s have it"
    best = labels[judgment.best]
    if not judgment.verdicts:
        return (f"no verdict on {judgment.label}: {best} has the best value, but the {noun}s "
                "have no standard errors to judge it by")
    close = {i: v for i, v in judgment.verdicts.items() if not v.significant}
    if close:
        who = ", ".join(f"{labels[i]} ({significance.p_text(v.p)}, {v.how})"
                        for i, v in close.items())
        return (f"no winner on {judgment.label}: {best} has the best value, but the "
                f"difference to {who} is within noise (p >= {significance.ALPHA})")
    worst = max(judgment.verdicts.values(), key=lambda v: v.p)
    return (f"winner on {judgment.label}: {best}, better than every other {noun} beyond noise "
            f"(the closest: {significance.p_text(worst.p)}, {worst.how})")

"""Runs that differ only in ``training.seed``, judged together: the points of a ``kiln sweep
--seeds N`` (or any runs given to ``kiln compare`` that repeat settings with other seeds).

One run's standard error is the sampling noise of its held-out examples. What a change to a
recipe has to beat is usually larger: the spread between training runs of other seeds
(initialisation, data order, dropout). So where every setting was run with two seeds or more,
each setting is a point: the mean of its runs' scores, with the standard error of that mean
over its seeds, and points are tested against the best one by a t-test over the seeds, paired
by seed where both points ran the same seeds (the same seed means the same initialisation and
data order: common random numbers), else Welch's. Runs scored on different held-out data are
not judged, as in ``judge``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.recipes.config.diff import differing, settings_label
from kiln.recipes.runs import significance
from kiln.recipes.runs.judge import Judgment
from kiln.recipes.runs.read import RECENT
from kiln.recipes.runs.significance import Verdict

SEED = "training.seed"


@dataclass
class Point:
    label: str  # the settings that tell it from the other points: "lr=0.001"
    members: list[int]  # its runs (row indices)
    seeds: list[Any]  # each member's training.seed


def points(recipes: list[Any]) -> list[Point]:
    """The runs grouped by everything but their seed; [] unless the seed differs and every
    group holds two runs or more (a lone run has no spread over seeds)."""
    if len(recipes) < 2:
        return []
    diffs = differing(recipes)
    if SEED not in diffs:
        return []
    others = {k: v for k, v in diffs.items() if k != SEED}
    groups: dict[str, list[int]] = {}
    for i in range(len(recipes)):
        key = json.dumps([v[i] for v in others.values()], default=str, sort_keys=True)
        groups.setdefault(key, []).append(i)
    if any(len(members) < 2 for members in groups.values()):
        return []
    out = []
    for members in groups.values():
        out.append(Point(settings_label(others, members[0]) or "all runs", members,
                         [diffs[SEED][i] for i in members]))
    return out


# Where a summary row keeps a judged column's standard error, besides tasks' ``task_info``
INFO_KEYS = {"eval_loss": "eval_info", "reward": "reward_info"}


def value_of(row: dict[str, Any], column: str) -> float | None:
    """A judged column's value in a run's summary row."""
    if column in INFO_KEYS:
        return row.get(column)
    return row.get("task_info", {}).get(column[len("task/"):], {}).get("value")


def point_judgments(judged: list[Judgment], rows: list[dict[str, Any]]) -> list[Judgment]:
    """The columns judged across seeds: the runs' judged columns, and an RL run's reward, which
    has no error bar in one run (a batch's mean, the policy moving) but is one independent value
    per seed."""
    if not any(r.get("reward") is not None for r in rows):
        return judged
    return [*judged, Judgment("reward", f"reward (last {RECENT})", lower=False)]


def point_rows(groups: list[Point], rows: list[dict[str, Any]],
               judged: list[Judgment]) -> list[dict[str, Any]]:
    """A summary row per point, shaped like a run's (``compare.render`` shows it): each judged
    column's mean over the point's seeds, with that mean's standard error."""
    out = []
    for g in groups:
        row: dict[str, Any] = {"run": g.label, "seeds": ",".join(map(str, g.seeds)),
                               "task_info": {}, "task_metrics": {}}
        for j in judged:
            values = _values(g, rows, j.column)
            mean = float(np.mean(values)) if values else None
            se = _stderr(values)
            if j.column in INFO_KEYS:
                row[j.column], row[INFO_KEYS[j.column]] = mean, {"stderr": se}
            else:
                name = j.column[len("task/"):]
                metrics = [r["task_metrics"][name] for r in rows
                           if name in r.get("task_metrics", {})]
                row[j.column] = mean
                row["task_info"][name] = {"value": mean, "stderr": se}
                if metrics:
                    row["task_metrics"][name] = metrics[0]
        out.append(row)
    return out


def judge_points(groups: list[Point], rows: list[dict[str, Any]],
                 judged: list[Judgment]) -> list[Judgment]:
    """Per judged column: the best point (lowest loss, highest score) and each other point's
    test against it over the seeds. A column whose runs were scored on different data keeps
    its note and is not judged."""
    out = []
    for j in judged:
        result = Judgment(j.column, j.label, note=j.note, lower=j.lower)
        values = [_values(g, rows, j.column) for g in groups]
        have = [i for i, v in enumerate(values) if v]
        if j.note or len(have) < 2:
            out.append(result)
            continue
        means = {i: float(np.mean(values[i])) for i in have}
        best = min(have, key=lambda i: means[i] if j.lower else -means[i])
        result.best = best
        for i in have:
            if i != best:
                verdict = _test(groups[i], values[i], groups[best], values[best])
                if verdict is not None:
                    result.verdicts[i] = verdict
        out.append(result)
    return out


def few_seeds(groups: list[Point]) -> str | None:
    """A caution where a point has only two seeds: a t-test over two seeds has one degree of
    freedom, so it calls only differences far beyond the seeds' spread."""
    fewest = min(len(g.seeds) for g in groups)
    if fewest > 2:
        return None
    return ("note: a point with 2 seeds gives its t-test 1 degree of freedom, so only "
            "differences far beyond the spread between seeds are called; run 3 seeds or more "
            "(kiln sweep --seeds 3) before reading 'within noise' as 'the same'")


def _values(g: Point, rows: list[dict[str, Any]], column: str) -> list[float]:
    return [v for i in g.members if (v := value_of(rows[i], column)) is not None
            and math.isfinite(v)]


def _stderr(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    return float(np.std(values, ddof=1) / math.sqrt(len(values)))


def _test(a: Point, a_values: list[float], b: Point, b_values: list[float]) -> Verdict | None:
    """Paired by seed when both points ran the same distinct seeds (every run scored), else
    Welch's t; None below two runs a side."""
    if len(a_values) < 2 or len(b_values) < 2:
        return None
    if (len(a_values) == len(a.seeds) and len(b_values) == len(b.seeds)
            and len(set(a.seeds)) == len(a.seeds) and sorted(a.seeds) == sorted(b.seeds)):
        by_seed_a = dict(zip(a.seeds, a_values, strict=True))
        by_seed_b = dict(zip(b.seeds, b_values, strict=True))
        order = sorted(a.seeds)
        return significance.paired(np.array([by_seed_a[s] for s in order]),
                                   np.array([by_seed_b[s] for s in order]), unit="seeds")
    return significance.welch(np.array(a_values), np.array(b_values))

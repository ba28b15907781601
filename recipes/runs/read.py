"""Reading finished or running runs back: a run folder's recipe and its logged metrics.

Used by ``kiln compare``, ``kiln plot``, ``kiln sweep`` and the trainer's plot refresh. A run
folder holds ``recipe.toml`` (written after the first step) and ``metrics.jsonl`` (one JSON
object per logged step: training lines, evaluation lines); an MoE run also ``experts.jsonl``
(per-expert loads, written by the routing-health hook); a run with ``mode = "pause"`` tasks
``downstream_eval.jsonl`` (their scores, written by ``kiln eval RUN --pending``).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.components.errors import RecipeError
from kiln.components.tasks.common import STDERR

# What a run folder looks like, for the messages that reject one.
EXPERTS_FILE = "experts.jsonl"  # per-expert loads of MoE runs (recipes/hooks/routing.py)
DOWNSTREAM_FILE = "downstream_eval.jsonl"  # pause-mode task scores (recipes/inference/pending.py)
RUN_FOLDER = "a run folder holds recipe.toml and metrics.jsonl (runs/<name>/ after `kiln train`)"


@dataclass
class Run:
    folder: Path
    recipe: Any  # kiln.recipes.config.schema.Recipe
    records: list[dict[str, Any]] = field(default_factory=list)
    label: str = ""  # how tables and legends name it: the folder name, or its path

    def __post_init__(self) -> None:
        self.label = self.label or self.folder.name

    def metric_keys(self) -> list[str]:
        """Every numeric metric the run logged, sorted."""
        return sorted({k for r in self.records for k, v in r.items()
                       if k not in ("step", "time", "session") and _number(v) is not None})


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSONL file. A torn last line (a run killed while writing it) is left
    out; a bad line elsewhere (not JSON, not UTF-8, no step) is left out with a warning naming
    it. Lines are decoded one by one, so damaged bytes cost their line only."""
    try:
        lines = path.read_bytes().splitlines()
    except OSError as exc:
        raise RecipeError(f"{path}: cannot read it ({exc.strerror})") from None
    out = []
    for i, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        why = "not a metrics line"
        try:
            obj = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            obj, why = None, "not UTF-8 text"
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict) or not isinstance(obj.get("step"), int):
            if i != len(lines):
                print(f"kiln: warning: {path}:{i}: {why}, left out", file=sys.stderr)
            continue
        out.append(obj)
    return _latest_session(out)


def _latest_session(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A resumed run logs again the steps after its checkpoint: the later lines win. The first
    line of each session carries ``session: {"from_step": S}`` (``MetricsWriter``): the earlier
    lines above step S go. Files from before that marker, and lines the marker cannot place,
    go by their keys: a line whose step is not above the previous step of lines with the same
    keys drops those lines from that step on (the tasks of one evaluation log one line each at
    the same step, with different keys)."""
    kept: list[dict[str, Any]] = []
    last: dict[Any, int] = {}
    for rec in records:
        start = _session_start(rec)
        if start is not None:
            kept = [r for r in kept if r["step"] <= start]
            last = {}
        kind = _kind(rec)
        if kind in last and rec["step"] <= last[kind]:
            kept = [r for r in kept if _kind(r) != kind or r["step"] < rec["step"]]
        kept.append(rec)
        last[kind] = rec["step"]
    return kept


def _session_start(rec: dict[str, Any]) -> int | None:
    marker = rec.get("session")
    start = marker.get("from_step") if isinstance(marker, dict) else None
    return start if isinstance(start, int) and not isinstance(start, bool) else None


def _kind(rec: dict[str, Any]) -> Any:
    """Training lines hold the loss (their other keys vary: MFU, guard counters); any other
    line is named by its keys (an evaluation's, one task's, the diagnostics')."""
    if "loss" in rec:
        return "train"
    return frozenset(k for k in rec if k not in ("step", "time", "session"))


def open_run(path: str | Path, *, need_metrics: bool = True) -> Run:
    """The run in ``path``; a clear RecipeError when it is not a run or has no metrics yet."""
    from kiln.recipes.config.files import load_recipe

    folder = Path(path)
    if not folder.is_dir():
        raise RecipeError(f"{folder}: no such folder; {RUN_FOLDER}")
    if not (folder / "recipe.toml").is_file():
        inside = sorted(p.name for p in folder.iterdir())[:8]
        runs = sorted(p.parent.name for p in folder.glob("*/recipe.toml"))[:8]
        hint = (f"; runs inside it: {', '.join(runs)}" if runs else
                f"; it holds: {', '.join(inside) or 'nothing'}")
        raise RecipeError(f"{folder}: not a run folder (no recipe.toml){hint}; {RUN_FOLDER}")
    recipe = load_recipe(folder / "recipe.toml")
    metrics = folder / "metrics.jsonl"
    records = read_jsonl(metrics) if metrics.is_file() else []
    if need_metrics and not records:
        raise RecipeError(
            f"{folder}: no metrics yet ({'empty ' if metrics.is_file() else 'no '}"
            f"metrics.jsonl); the trainer writes a line every run.log_interval steps"
        )
    return Run(folder, recipe, records)


def open_runs(paths: list[str]) -> list[Run]:
    runs = [open_run(p) for p in paths]
    names = [r.label for r in runs]
    if len(set(names)) < len(names):  # same folder names in different places: label by path
        for run in runs:
            run.label = str(run.folder)
    return runs


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def series(run: Run, key: str, x: str = "step") -> tuple[list[float], list[float]]:
    """(xs, ys) of a metric; x is "step", "tokens" (tokens seen) or "time" (seconds of
    training: the logging intervals summed, so a pause between a crash and its resume does not
    count)."""
    xs, ys = [], []
    to_x = _x_axis(run, x)
    for rec in run.records:
        y = _number(rec.get(key))
        if y is None or not math.isfinite(y):
            continue
        xs.append(to_x(rec["step"]))
        ys.append(y)
    return xs, ys


_WARNED: set[tuple[str, int]] = set()  # (run folder, lines left out of the time axis)


def _x_axis(run: Run, x: str):
    if x == "step":
        return float
    train = [r for r in run.records if "loss" in r]
    if x == "tokens":
        known = [(r["step"], r["tokens_seen"]) for r in train if "tokens_seen" in r]
    elif x == "time":
        known, total, bad = [], 0.0, 0
        for r in train:
            seconds = _number(r.get("interval_s", 0.0))
            if seconds is None or not math.isfinite(seconds):  # its step is interpolated
                bad += 1
                continue
            total += seconds
            known.append((r["step"], total))
        if bad and (str(run.folder), bad) not in _WARNED:  # once, not once per curve
            _WARNED.add((str(run.folder), bad))
            print(f"kiln: warning: {run.folder / 'metrics.jsonl'}: {bad} lines whose interval_s "
                  "is not a number, left out of the time axis", file=sys.stderr)
    else:
        raise ValueError(f"x must be step, tokens or time, got {x!r}")
    return lambda step: _interpolate(known, step)


def _interpolate(known: list[tuple[int, float]], step: int) -> float:
    """The x value of ``step`` from the training lines around it (evaluation lines fall on
    logged steps, or between two)."""
    if not known:
        return float("nan")
    before = [(s, v) for s, v in known if s <= step]
    after = [(s, v) for s, v in known if s >= step]
    if not before:
        s, v = after[0]
        return v * step / s if s else v
    s0, v0 = before[-1]
    if s0 == step or not after:
        return v0
    s1, v1 = after[0]
    return v0 + (v1 - v0) * (step - s0) / (s1 - s0)


def pick(run: Run, names: list[str]) -> list[str]:
    """The run's keys a metric name selects: itself, or every ``name/...`` key (``lr`` ->
    ``lr/main``, ``lr/main/no_decay``); ``name/*`` selects the ``name/...`` keys only
    (``eval/loss/*``: a mixture's per-source evaluations, not the overall ``eval/loss``)."""
    keys = run.metric_keys()
    out = []
    for name in names:
        if name.endswith("/*"):
            out += [k for k in keys if k.startswith(name[:-1])]
        elif name in keys:
            out.append(name)
        else:
            out += [k for k in keys if k.startswith(name + "/")]
    return out


# An RL run's reward is one batch's (noisy, and the policy moves): its figure is the mean of the
# last RECENT logged values (fewer when it logged fewer)
RECENT = 10


def summary(run: Run) -> dict[str, Any]:
    """Final and best figures of a run (None where it logged nothing of the kind)."""
    train = [r for r in run.records if _number(r.get("loss")) is not None]
    losses = [float(r["loss"]) for r in train if math.isfinite(float(r["loss"]))]
    rewards = [v for r in train if (v := _number(r.get("reward"))) is not None][-RECENT:]
    evals = [r for r in run.records if _number(r.get("eval/loss")) is not None]
    eval_losses = [float(r["eval/loss"]) for r in evals]
    out: dict[str, Any] = {
        "run": run.label,
        "steps": max((r["step"] for r in run.records), default=0),
        "final_loss": losses[-1] if losses else None,
        "best_loss": min(losses) if losses else None,
        "eval_loss": eval_losses[-1] if eval_losses else None,
        "best_eval_loss": min(eval_losses) if eval_losses else None,
        "eval_bpb": _last(run, "eval/bpb"),
        "reward": sum(rewards) / len(rewards) if rewards else None,
        "tokens_per_second": _median([r.get("tokens_per_second") for r in train[1:] or train]),
        "mfu": _median([r.get("mfu") for r in train[1:] or train]),
        "wall_clock_s": sum(float(r.get("interval_s", 0.0)) for r in train) or _span(run),
    }
    for name, value in source_evals(run).items():
        out[f"source/{name}"] = value
    for name, (metric, points) in task_scores(run).items():
        out[f"task/{name}"] = points[-1][1]
        out.setdefault("task_metrics", {})[name] = metric
    out["task_info"] = task_details(run)
    out["eval_info"] = eval_details(run)
    out["total_steps"] = total_steps(run)
    return out


def total_steps(run: Run) -> int | None:
    """Where the run ends: its last session's ``total_steps`` (``MetricsWriter``), else the
    recipe's ``training.steps``; None when neither says (a budget in tokens or epochs, logged
    before the marker carried it)."""
    for rec in reversed(run.records):
        marker = rec.get("session")
        if isinstance(marker, dict) and isinstance(marker.get("total_steps"), int):
            return marker["total_steps"]
    steps = getattr(getattr(run.recipe, "training", None), "steps", 0)
    return steps if isinstance(steps, int) and steps > 0 else None


def source_evals(run: Run) -> dict[str, float]:
    """A mixture run's last held-out loss per source (``eval/loss/NAME``), by source."""
    out = {}
    for key in sorted(k for k in run.metric_keys() if k.startswith("eval/loss/")):
        if (value := _last(run, key)) is not None:
            out[key[len("eval/loss/"):]] = value
    return out


def task_scores(run: Run) -> dict[str, tuple[str, list[tuple[int, float]]]]:
    """Per downstream task: its headline metric and its (step, value) points, by step, from
    the in-loop lines (``eval/<task>/<metric>``) and ``downstream_eval.jsonl``; a step's own
    score (``StepContract.scores``, e.g. ``eval/rewards/accuracies``) counts as one."""
    types = {name: cfg.type for name, cfg in run.recipe.evals.items()}
    logged: dict[str, dict[str, dict[int, float]]] = {}  # task -> metric -> step -> value
    for rec in run.records:
        for key, value in rec.items():
            head, _, metric = key.rpartition("/")
            if head in ("eval/loss", "eval/bpb"):  # a mixture's per source, not a task
                continue
            if head.startswith("eval/") and (number := _number(value)) is not None:
                logged.setdefault(head[5:], {}).setdefault(metric, {})[rec["step"]] = number
    path = run.folder / DOWNSTREAM_FILE
    for rec in read_jsonl(path) if path.is_file() else []:
        tasks = rec.get("tasks")
        for name, result in (tasks.items() if isinstance(tasks, dict) else ()):
            metrics = result.get("metrics") if isinstance(result, dict) else None
            if not isinstance(metrics, dict):
                continue
            types.setdefault(name, str(result.get("type", "")))
            for metric, value in metrics.items():
                if (number := _number(value)) is not None:
                    logged.setdefault(name, {}).setdefault(metric, {})[rec["step"]] = number
    out = {}
    for name, metrics in logged.items():
        scores = [m for m in metrics if not _auxiliary(m)]
        # a task of the recipe or the downstream file, or a step's own score (it logs its
        # examples); not a step's other held-out values (a preference step's eval/logps/...)
        if not scores or (name not in types and "examples" not in metrics):
            continue
        metric = _headline(types.get(name, ""), scores)
        out[name] = (metric, sorted(metrics[metric].items()))
    return out


def _auxiliary(metric: str) -> bool:
    """A task's standard errors and example count, logged beside its metrics."""
    return metric.endswith(STDERR) or metric == "examples"


def task_details(run: Run) -> dict[str, dict[str, Any]]:
    """Per in-loop task, at its last evaluation: the headline metric's value, standard error,
    example count, fingerprint and step (None where the run did not log them: older runs)."""
    out = {}
    for name, (metric, points) in task_scores(run).items():
        step, value = points[-1]
        line = {k: v for r in run.records if r["step"] == step for k, v in r.items()
                if k.startswith(f"eval/{name}/")}
        fingerprint = line.get(f"eval/{name}/fingerprint")
        out[name] = {"metric": metric, "value": value, "step": step,
                     "stderr": _number(line.get(f"eval/{name}/{metric}{STDERR}")),
                     "examples": _number(line.get(f"eval/{name}/examples")),
                     "fingerprint": fingerprint if isinstance(fingerprint, str) else None}
    return out


def eval_details(run: Run) -> dict[str, Any]:
    """The last held-out loss's standard error, batch count, fingerprint and step."""
    lines = [r for r in run.records if _number(r.get("eval/loss")) is not None]
    if not lines:
        return {}
    last = lines[-1]
    fingerprint = last.get("eval/fingerprint")
    return {"stderr": _number(last.get("eval/loss_stderr")),
            "batches": _number(last.get("eval/batches")), "step": last["step"],
            "fingerprint": fingerprint if isinstance(fingerprint, str) else None}


def _headline(task_type: str, metrics: list[str]) -> str:
    """The task kind's ``headline`` metric (components/tasks), else the first one logged (a
    kind no longer registered, or one without a headline)."""
    from kiln.components import registry

    try:
        name = getattr(registry.get("task", task_type).obj, "headline", "")
    except registry.RegistryError:
        name = ""
    return name if name in metrics else metrics[0]


def _last(run: Run, key: str) -> float | None:
    values = [_number(r[key]) for r in run.records if key in r]
    values = [v for v in values if v is not None]
    return values[-1] if values else None


def _median(values: list[Any]) -> float | None:
    nums = sorted(v for v in map(_number, values) if v is not None)
    if not nums:
        return None
    mid = len(nums) // 2
    return nums[mid] if len(nums) % 2 else (nums[mid - 1] + nums[mid]) / 2


def _span(run: Run) -> float | None:
    """Seconds from the first to the last metrics line (runs logged before interval_s)."""
    times = [float(r["time"]) for r in run.records if _number(r.get("time")) is not None]
    return times[-1] - times[0] if len(times) > 1 else None

"""A ladder's points: (parameters, tokens, FLOPs, loss) per size, from run folders or a CSV.

A ladder is named on the command line by one path:

- a CSV file with a header holding ``params``, ``tokens`` and ``loss`` (``flops`` and
  ``label`` optional; FLOPs default to 6 N D): published ladders, other tools' runs;
- a folder of run folders (what ``kiln ladder`` writes: one run folder per size), or a folder
  holding ``ladder.toml`` (its runs are the sizes it lists).

From a run folder: parameters from the recipe's model built on the meta device (by default
without the embedding table, as Kaplan et al. 2020 count them: at small sizes the table is most
of the model and bends the curve; ``--params total`` counts everything), tokens from the last
logged ``tokens_seen``, FLOPs as kiln's MFU counts them (the model's ``flops_per_token`` at the
recipe's sequence length, times tokens), loss from the last in-loop evaluation (``eval/loss``)
or, with ``--loss train``, the mean training loss over the last tenth of the logged steps. A
run that has not reached its last step, or whose loss is not finite, is refused by name.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kiln.components.errors import RecipeError
from kiln.recipes.runs.read import Run, open_run

LOSSES = ("eval", "train")
PARAM_COUNTS = ("non-embedding", "total")
CSV_COLUMNS = ("params", "tokens", "loss")


@dataclass(frozen=True)
class Point:
    label: str
    params: float
    tokens: float
    flops: float
    loss: float


@dataclass(frozen=True)
class Ladder:
    name: str
    points: tuple[Point, ...]

    def column(self, key: str) -> np.ndarray:
        return np.array([getattr(p, key) for p in self.points], dtype=np.float64)


def read_ladder(path: str | Path, *, loss: str = "eval",
                params: str = "non-embedding") -> Ladder:
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() != ".csv":
            raise RecipeError(f"{path}: a ladder is a CSV of params,tokens,loss rows or a folder "
                              "of run folders (kiln ladder writes one)")
        return Ladder(str(path), tuple(read_csv(path)))
    if not path.is_dir():
        raise RecipeError(f"{path}: no such file or folder (a ladder is a CSV or a folder of "
                          "run folders)")
    points = [run_point(run, loss=loss, params=params) for run in ladder_runs(path)]
    return Ladder(str(path), tuple(sorted(points, key=lambda p: (p.params, p.tokens))))


def ladder_runs(folder: Path) -> list[Run]:
    """The run folders of a ladder folder (each checked by ``run_point``)."""
    folders = sorted(p.parent for p in folder.glob("*/recipe.toml"))
    if not folders:
        raise RecipeError(f"{folder}: no run folders inside (a ladder folder holds one run "
                          "folder per size: kiln ladder RECIPE --sizes ... writes them)")
    return [open_run(f) for f in folders]


def run_point(run: Run, *, loss: str = "eval", params: str = "non-embedding") -> Point:
    from kiln.recipes.loading.meta_model import build_meta_model

    if loss not in LOSSES or params not in PARAM_COUNTS:
        raise RecipeError(f"--loss is one of {LOSSES}, --params one of {PARAM_COUNTS}")
    where = str(run.folder)
    last_step = max((r.get("step", 0) for r in run.records), default=0)
    steps = run.recipe.training.steps
    if last_step < steps:
        raise RecipeError(f"{where}: unfinished (last logged step {last_step} of {steps}): "
                          "finish it (kiln train resumes it) or leave it out of the ladder")
    value = _loss(run, loss)
    if not math.isfinite(value):
        raise RecipeError(f"{where}: its {loss} loss is {value} (a diverged run): leave it out "
                          "of the ladder or rerun it with a lower learning rate")
    tokens = max((float(r["tokens_seen"]) for r in run.records if "tokens_seen" in r),
                 default=0.0)
    if tokens <= 0:
        raise RecipeError(f"{where}: no tokens_seen in metrics.jsonl (a run of an older kiln?)")
    model = build_meta_model(run.recipe)
    n = model.num_params(exclude_embeddings=params == "non-embedding")
    flops = model.flops_per_token(run.recipe.training.seq_len) * tokens
    return Point(run.label, float(n), tokens, float(flops), value)


def _loss(run: Run, kind: str) -> float:
    if kind == "eval":
        evals = [float(r["eval/loss"]) for r in run.records if "eval/loss" in r]
        if not evals:
            raise RecipeError(f"{run.folder}: no eval/loss logged (its recipe has no in-loop "
                              "evaluation); fit the training loss with --loss train")
        return evals[-1]
    train = [float(r["loss"]) for r in run.records if "loss" in r]
    tail = train[-max(1, len(train) // 10):]
    return float(np.mean(tail)) if tail else math.nan


def read_csv(path: Path) -> list[Point]:
    """Rows of params,tokens,loss (flops, label optional); one error naming row and column."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        header = [h.strip() for h in reader.fieldnames or []]
    missing = [c for c in CSV_COLUMNS if c not in header]
    if not rows or missing:
        raise RecipeError(f"{path}: needs a header with {', '.join(CSV_COLUMNS)} (flops and "
                          f"label optional) and one row per size; "
                          f"{'no rows' if not rows else 'missing ' + ', '.join(missing)}")
    out = []
    for i, row in enumerate(rows, start=2):  # line 1 is the header
        row = {k.strip(): (v or "").strip() for k, v in row.items() if k}
        values = {}
        for key in ("params", "tokens", "loss", "flops"):
            if key == "flops" and not row.get("flops"):
                continue
            try:
                values[key] = float(row[key])
            except ValueError:
                raise RecipeError(f"{path}, line {i}: {key} = {row[key]!r} is not a number") \
                    from None
        flops = values.get("flops", 6.0 * values["params"] * values["tokens"])
        out.append(Point(row.get("label") or f"line {i}", values["params"], values["tokens"],
                         flops, values["loss"]))
    return out

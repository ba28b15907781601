"""Per-example scores of a run's evaluations, kept so two runs can be compared example by example.

Each in-loop evaluation writes ``RUN/evals/tasks/<name>/step_NNNNNNN.npz`` (a task of
``[evals]``) or ``RUN/evals/loss/step_NNNNNNN.npz`` (the held-out loss). ``values`` (units,
columns) float64 and ``columns`` (their names): for a task the per-example values its metrics
average (``acc``, ``exact_match``, a window's ``nll``), for the loss each eval batch's summed
loss and token count (``loss_sum``, ``tokens``). ``kiln compare`` pairs two runs on them when
both scored the same examples (the same fingerprint, logged as ``eval/<name>/fingerprint``).
Plain arrays, read with ``allow_pickle=False``; written through a temporary file and a rename.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

FOLDER = "evals"
LOSS = "loss"  # the held-out loss's folder, beside tasks/ (no clash with a task's name)


def path(run_dir: Path, name: str, step: int, *, task: bool = True) -> Path:
    """Where a task's (``task``) or the held-out loss's scores of ``step`` go."""
    return Path(run_dir) / FOLDER / ("tasks" if task else "") / name / f"step_{step:07d}.npz"


def save(run_dir: Path, name: str, step: int, values: np.ndarray, columns: list[str], *,
         task: bool = True) -> Path:
    target = path(run_dir, name, step, task=task)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez(f, values=np.asarray(values, dtype=np.float64),
                 columns=np.asarray(columns, dtype=str))
    os.replace(tmp, target)
    return target


def load(run_dir: Path, name: str, step: int, *, task: bool = True
         ) -> tuple[np.ndarray, list[str]] | None:
    """(values, columns) of one evaluation, or None when the run kept none (an older run, a
    damaged or missing file: the comparison then falls back to the standard errors)."""
    target = path(run_dir, name, step, task=task)
    try:
        with np.load(target, allow_pickle=False) as data:
            values, columns = data["values"], [str(c) for c in data["columns"]]
    except (OSError, ValueError, KeyError):
        return None
    if values.ndim != 2 or values.shape[1] != len(columns):
        return None
    return values, columns

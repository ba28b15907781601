"""Training the points of a sweep or a ladder one after another, each in its own process:
a finished point (its ``sweep_done.json``) is skipped, a partial one continues from its newest
checkpoint, and a point another sweep is training is claimed (``sweep.lock``) and waited for
after the others."""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
from pathlib import Path

from kiln.components.errors import RecipeError, RunFolderInUse
from kiln.recipes.runs.launch import die_with_parent
from kiln.recipes.runs.lock import RunLock, holder_of
from kiln.recipes.runs.sweep import mark_done

CLAIM = "sweep.lock"  # a point's folder, held by the sweep training it (run_lock.RunLock)


def _train_command(recipe: str, args: list[str]) -> list[str]:
    """One process: kiln's trainer under this interpreter. NGPU / NNODES > 1: run_train.sh of
    the working folder (torchrun with kiln's error reporting, as for a single run)."""
    if int(os.environ.get("NGPU", "1")) <= 1 and int(os.environ.get("NNODES", "1")) <= 1:
        return [sys.executable, "-m", "kiln.recipes.cli", "train", recipe, *args]
    script = Path("run_train.sh")
    if not (script.is_file() and os.access(script, os.X_OK)):
        raise RecipeError("NGPU / NNODES > 1 needs ./run_train.sh: run kiln sweep from the kiln "
                          "checkout (where run_train.sh is)")
    return ["./run_train.sh", recipe, *args]


def train_points(recipe: str, extra: list[str], points, tag: str = "kiln sweep") -> list[str]:
    """Train each point not yet finished, one after another; a point another sweep holds is
    trained after the others (when that sweep lets go of it). The failed points' lines."""
    failed, busy = [], []

    def train(i: int, point) -> None:
        if point.finished:  # also by another sweep of the same grid
            print(f"{tag}: [{i}/{len(points)}] {point.folder} finished; skipped")
            return
        what = ", ".join(f"{k}={v}" for k, v in point.values)
        state = "continues" if (point.folder / "recipe.toml").is_file() else "starts"
        print(f"{tag}: [{i}/{len(points)}] {what} {state} in {point.folder}", flush=True)
        cmd = _train_command(recipe, [*extra, *point.overrides])
        # the run dies with the sweep (kill -9 of it too): a rerun continues the point alone
        status = subprocess.call(cmd, preexec_fn=functools.partial(die_with_parent, os.getpid()))
        if status == 0:
            mark_done(point)
        else:
            failed.append(f"{point.folder} (exit {status}): {shlex.join(cmd)}")

    for i, point in enumerate(points, 1):
        try:  # the point is this sweep's while it trains it and records the outcome
            claim = RunLock.take(point.folder, tag, name=CLAIM)
        except RunFolderInUse:
            print(f"{tag}: [{i}/{len(points)}] {point.folder} is being trained by another "
                  f"sweep ({holder_of(point.folder / CLAIM)}); back to it after the other points",
                  flush=True)
            busy.append((i, point))
            continue
        try:
            train(i, point)
        finally:
            claim.release()
    for i, point in busy:  # then wait for the other sweep: it may also stop before the end
        print(f"{tag}: [{i}/{len(points)}] waiting for the other sweep to end "
              f"{point.folder}", flush=True)
        claim = RunLock.take(point.folder, tag, name=CLAIM, wait=True)
        try:
            train(i, point)
        finally:
            claim.release()
    return failed

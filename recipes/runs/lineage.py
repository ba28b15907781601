"""Where a run comes from, so a model's life draws as one curve: a run that starts from another
run's weights (an anneal from a checkpoint, a fine-tune of an export) records its parent.

``RUN/parent.json`` (written with the run's recipe after its first step): the parent run's
folder, the checkpoint, its step and tokens, and how the weights came (``weights_only``: a
checkpoint resumed with ``checkpoint.weights_only``; ``init_from``: an export of a kiln
checkpoint, which carries ``kiln_source.json``). ``kiln plot`` draws such a run at its true
offset (the parent's step, tokens or training time at the checkpoint) and, with ``--join``,
as one curve with its parent. A mixture run logs ``data/stage_start`` (the first step of the
stage it is in): its switches are marked on the per-source panels.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kiln.recipes.runs.read import Run, series

PARENT = "parent.json"
EXPORT_SOURCE = "kiln_source.json"  # in an export folder: the checkpoint it was written from


def write_export_source(out_dir: Path, checkpoint: Path) -> None:
    """Beside an export of ``checkpoint``: the run, checkpoint, step and tokens it holds."""
    from kiln.checkpointing.resume import parent_record
    from kiln.recipes.config.files import write_text_atomic

    record = {k: v for k, v in parent_record(checkpoint, "export").items() if k != "how"}
    write_text_atomic(Path(out_dir) / EXPORT_SOURCE, json.dumps(record, indent=1))


def export_source(folder: Path) -> dict[str, Any] | None:
    """The ``kiln_source.json`` of an export folder, or None (not a kiln export, unreadable)."""
    return _read(Path(folder) / EXPORT_SOURCE)


def parent_of(run: Run) -> dict[str, Any] | None:
    """The run's ``parent.json``: {run, checkpoint, step, tokens, how}, or None."""
    return _read(run.folder / PARENT)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    ok = isinstance(data, dict) and all(
        isinstance(data.get(k), int) and not isinstance(data.get(k), bool)
        for k in ("step", "tokens")) and isinstance(data.get("run"), str)
    return data if ok else None


def offset(run: Run, x: str, runs: list[Run] = ()) -> float:
    """Where the run's own step 0 lies on the ``x`` axis: the parent's step or tokens at the
    checkpoint; for training time, the parent's time up to that step (its metrics are read
    from ``runs`` or its folder; 0 when they cannot be read). 0 for a run without a parent."""
    parent = parent_of(run)
    if parent is None:
        return 0.0
    if x in ("step", "tokens"):
        return float(parent[x]) + offset_of_parent(parent, x, runs)
    found = find_run(parent, runs)
    if found is None:
        return 0.0
    xs, _ = series(found, "loss", "time")
    steps, _ = series(found, "loss", "step")
    upto = [t for t, s in zip(xs, steps, strict=True) if s <= parent["step"]]
    return (upto[-1] if upto else 0.0) + offset(found, x, runs)


def offset_of_parent(parent: dict[str, Any], x: str, runs: list[Run]) -> float:
    """A grandparent's offset: an anneal of an anneal starts where its whole line left off."""
    found = find_run(parent, runs)
    return offset(found, x, runs) if found is not None else 0.0


def find_run(parent: dict[str, Any], runs: list[Run]) -> Run | None:
    """The parent among ``runs`` (by its resolved folder), else opened from its folder."""
    want = Path(parent["run"]).resolve()
    for run in runs:
        if run.folder.resolve() == want:
            return run
    from kiln.components.errors import RecipeError
    from kiln.recipes.runs.read import open_run

    try:
        return open_run(want, need_metrics=False)
    except (RecipeError, OSError):
        return None


def lines(runs: list[Run]) -> list[list[int]]:
    """Runs grouped into lines of descent, parents first: runs whose parent is among ``runs``
    join their parent's line (``kiln plot --join``); the others stand alone."""
    index = {run.folder.resolve(): i for i, run in enumerate(runs)}
    parent_at = {}
    for i, run in enumerate(runs):
        parent = parent_of(run)
        j = index.get(Path(parent["run"]).resolve()) if parent else None
        if j is not None and j != i:
            parent_at[i] = j
    out, seen = [], set()
    for i in range(len(runs)):
        if i in parent_at or i in seen:
            continue
        line, frontier = [i], [i]
        while frontier:  # children in the order given
            kids = [k for k, p in parent_at.items() if p in frontier and k not in line]
            line += kids
            frontier = kids
        seen.update(line)
        out.append(line)
    leftover = [i for i in range(len(runs)) if i not in seen]  # (a cycle of parents)
    return out + [[i] for i in leftover]


def stage_switches(run: Run) -> list[int]:
    """Steps where a mixture run entered a later stage (``data/stage_start`` > 0)."""
    _, starts = series(run, "data/stage_start")
    return sorted({int(s) for s in starts if math.isfinite(s) and s > 0})

"""Pause-mode requests (``[evals.NAME] mode = "pause"``): the pending files a paused run leaves in
its folder, and the results file ``kiln eval RUN --pending`` appends to. Written by the in-loop
hook, read by ``kiln eval --pending`` and by checkpoint rotation, which spares a snapshot that a
request names."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.checkpointing import layout
from kiln.recipes.runs.read import DOWNSTREAM_FILE

PENDING = "pending_downstream_eval.json"
RESULTS = DOWNSTREAM_FILE  # in the run folder: one line per `--pending` evaluation


def requested(run_dir: Path, log) -> set[tuple[int, str]]:
    """(step, task) of every request pending in ``run_dir`` and every result scored there."""
    out = set()
    for file in run_dir.glob("pending_downstream_eval*.json"):
        try:
            request = json.loads(file.read_text(encoding="utf-8"))
            out |= {(int(request["step"]), name) for name in request["tasks"]}
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log(f"kiln: WARNING: {file}: not a pending-evaluation file ({exc}); ignored")
    return out | scored(run_dir, log)


def pending_snapshots(run_dir: Path, root: Path) -> set[str]:
    """Names of the snapshots in ``root`` that a request pending in ``run_dir`` evaluates
    (checkpoint rotation spares them)."""
    out, root = set(), root.resolve()
    for file in run_dir.glob("pending_downstream_eval*.json"):
        try:
            folder = (run_dir / json.loads(file.read_text(encoding="utf-8"))["checkpoint"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a damaged request names no snapshot; `kiln eval --pending` reports it
        if folder.resolve().parent == root:
            out.add(folder.name)
    return out


def scored(run_dir: Path, log) -> set[tuple[int, str]]:
    """(step, task) of every result in ``run_dir``'s downstream_eval.jsonl; lines that are not
    a result are skipped and counted in one warning."""
    path = run_dir / RESULTS
    if not path.is_file():
        return set()
    out, bad = set(), 0
    with path.open("rb") as f:
        for line in f:
            try:
                record = json.loads(line)
                out |= {(int(record["step"]), str(name)) for name in record["tasks"]}
            except (ValueError, KeyError, TypeError):  # UnicodeDecodeError is a ValueError
                bad += line.strip() != b""
    if bad:
        log(f"kiln: WARNING: {path}: skipped {bad} line(s) that are not a result")
    return out


def write_pending(run_dir: Path, step: int, checkpoint: Path, tasks: dict, log) -> Path:
    """``pending_downstream_eval.json``; an earlier request not yet evaluated is kept beside it
    as ``pending_downstream_eval.step_XXXXXXX.json``."""
    path = run_dir / PENDING
    if path.is_file():
        try:
            old_step = int(json.loads(path.read_text(encoding="utf-8"))["step"])
        except (ValueError, KeyError, TypeError):
            old_step = -1
        kept = run_dir / f"pending_downstream_eval.{layout.step_name(max(old_step, 0))}.json"
        path.replace(kept)
        log(f"kiln: WARNING: the downstream evaluation of step {old_step} was not run yet; "
            f"kept as {kept}")
    layout.write_json(path, {"step": step, "checkpoint": str(checkpoint), "tasks": tasks,
                             "checksums": task_checksums(tasks)})
    return path


def task_checksums(tables: dict) -> dict[str, str]:
    """sha256 of each task's file (a task read from elsewhere, a folder or a hub dataset, has
    none): ``kiln eval --pending`` warns when a file changed after the pause."""
    import hashlib

    out = {}
    for name, table in tables.items():
        path = Path(str(table.get("path", "")))
        if table.get("path") and path.is_file():
            out[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out

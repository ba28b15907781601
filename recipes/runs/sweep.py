"""Sweeps: a recipe and a grid of override values -> one run per point, each in a folder named
after its values; run one after another here (``kiln sweep``) or as a SLURM job array.

A run is finished when its folder holds ``sweep_done.json`` (written after the run exits 0);
a rerun of the sweep skips it. A partial run continues from its newest checkpoint (the
trainer's ``checkpoint.resume = "auto"``).
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from kiln.components.errors import RecipeError
from kiln.recipes.config.diff import short_names
from kiln.recipes.config.loader import parse_override

DONE = "sweep_done.json"


@dataclass(frozen=True)
class Point:
    """One run of the sweep: its grid values (key, value as written) and its folder."""

    values: tuple[tuple[str, str], ...]
    folder: Path

    @property
    def overrides(self) -> list[str]:
        # folder and name as TOML strings: a bare word may not hold "=" or ","
        return [f"--{k}={v}" for k, v in self.values] + [
            f"--run.folder={json.dumps(str(self.folder))}",
            f"--run.name={json.dumps(self.folder.name)}"]

    @property
    def finished(self) -> bool:
        return (self.folder / DONE).is_file()


def split_values(text: str) -> list[str]:
    """``V1,V2`` split at commas outside brackets and quotes (``[0.9, 0.95],[0.9, 0.99]``)."""
    out, depth, quote, current = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(current.strip())
            current = ""
            continue
        current += ch
    out.append(current.strip())
    return out


def parse_grid(specs: list[str], seeds: int = 0,
               base_seed: int = 0) -> list[tuple[str, list[str]]]:
    """``["KEY=V1,V2", ...]`` -> [(key, [values])], each value checked as an override value;
    ``seeds`` adds ``training.seed`` = base_seed .. base_seed + seeds - 1."""
    grid: list[tuple[str, list[str]]] = []
    for spec in specs:
        key, sep, text = spec.partition("=")
        key = key.strip().removeprefix("--")
        if not sep or not key or not text.strip():
            raise RecipeError(f"--grid {spec!r}: write KEY=V1,V2 (e.g. --grid optimizer.lr="
                              "1e-3,3e-3)")
        values = split_values(text)
        if any(not v for v in values):
            raise RecipeError(f"--grid {spec!r}: an empty value (two commas, or one at an end)")
        for v in values:
            parse_override(f"--{key}={v}")  # syntax, before anything runs
        if len(set(values)) < len(values):
            raise RecipeError(f"--grid {spec!r}: a value is listed twice")
        if key in (k for k, _ in grid):
            raise RecipeError(f"--grid: key {key!r} given twice; list all its values in one "
                              "--grid")
        grid.append((key, values))
    if seeds:
        if "training.seed" in (k for k, _ in grid):
            raise RecipeError("--seeds and --grid training.seed=...: give one of them")
        grid.append(("training.seed", [str(base_seed + i) for i in range(seeds)]))
    if not grid:
        raise RecipeError("kiln sweep needs at least one --grid KEY=V1,V2 (or --seeds N)")
    return grid


def folder_name(values: tuple[tuple[str, str], ...], short: dict[str, str]) -> str:
    """``lr=1e-3,steps=60``: each key by its short name (dots as dashes, so the name never reads
    as a recipe override), each value as written, characters unsafe in paths as ``_``."""
    parts = []
    for key, value in values:
        text = re.sub(r"[^A-Za-z0-9._+-]", "_", value.strip("\"'")) or "_"
        parts.append(f"{short[key].replace('.', '-')}={text}")
    return ",".join(parts)


def expand(grid: list[tuple[str, list[str]]], sweep_dir: Path) -> list[Point]:
    """Every combination, the first key varying slowest."""
    short = short_names([k for k, _ in grid])
    points = []
    for combo in itertools.product(*(values for _, values in grid)):
        values = tuple(zip((k for k, _ in grid), combo, strict=True))
        points.append(Point(values, sweep_dir / folder_name(values, short)))
    names = [p.folder.name for p in points]
    if len(set(names)) < len(names):
        raise RecipeError("--grid: two values give the same folder name (they differ only in "
                          "characters replaced by _); write them differently")
    return points


def mark_done(point: Point) -> None:
    from kiln.recipes.config.files import write_text_atomic

    write_text_atomic(point.folder / DONE, json.dumps(
        {"finished": True, "overrides": [f"--{k}={v}" for k, v in point.values]}) + "\n")


def slurm_script(recipe: str, extra: list[str], points: list[Point], sweep_dir: Path,
                 workdir: Path, job_name: str) -> str:
    """A SLURM job-array script: task i trains point i with run_train.sh (multi-node when the
    job has several nodes) and marks it finished; a finished point's task exits at once."""
    runs = "\n".join(f"  {shlex.quote(str(p.folder))}" for p in points)
    args = "\n".join(f"  {shlex.quote(shlex.join([recipe, *extra, *p.overrides]))}"
                     for p in points)
    return f"""#!/bin/bash
# kiln sweep: {len(points)} runs of {recipe} as a SLURM job array, one task per run.
# Submit from anywhere: sbatch {workdir.resolve() / sweep_dir / 'sweep.sbatch'}
# (--chdir: the job runs in {workdir.resolve()}, and --output is relative to it)
# Each task trains with ./run_train.sh in {workdir}: NGPU processes per node (default: the
# GPUs SLURM gave the node, SLURM_GPUS_ON_NODE, else 1) on the job's nodes (--nodes; several
# nodes rendezvous at the first node's RDZV_PORT, default 29500). Add your site's options
# (--partition, --gpus-per-node, --time, --account) to the #SBATCH lines or to sbatch.
# A task whose run holds {DONE} exits at once; a partial run resumes from its checkpoint.
#SBATCH --job-name={job_name}
#SBATCH --array=0-{len(points) - 1}
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --chdir={workdir.resolve()}
#SBATCH --output={sweep_dir}/slurm-%A_%a.out
set -euo pipefail
cd {shlex.quote(str(workdir))}
RUNS=(
{runs}
)
ARGS=(
{args}
)
TASK=${{SLURM_ARRAY_TASK_ID:?run this script with sbatch (a job array)}}
RUN=${{RUNS[$TASK]}}
if [ -f "$RUN/{DONE}" ]; then
    echo "kiln sweep: $RUN is finished; skipped"
    exit 0
fi
export NGPU=${{NGPU:-${{SLURM_GPUS_ON_NODE:-1}}}}
export NNODES=${{SLURM_JOB_NUM_NODES:-1}}
# sed reads every line (head would close the pipe: SIGPIPE, exit 141 under pipefail)
FIRST_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)
export RDZV_ENDPOINT="$FIRST_NODE:${{RDZV_PORT:-29500}}"
export RDZV_ID="kiln-${{SLURM_ARRAY_JOB_ID:-0}}-$TASK"
eval "set -- ${{ARGS[$TASK]}}"
# one launcher per node; each learns its NODE_RANK from SLURM
srun --ntasks-per-node=1 --nodes="$NNODES" \\
    bash -c 'NODE_RANK=$SLURM_NODEID exec ./run_train.sh "$@"' run_train "$@"
printf '{{"finished": true}}\\n' > "$RUN/{DONE}"
"""

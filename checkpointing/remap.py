"""Resume on another layout: map the saved processes' per-rank state onto this process.

A rank file holds two kinds of state besides its RNG. *Global* state is the same on every rank:
the guards' state (their statistics are all-reduced) and the data cursor (global step ``g``
reads rows ``[g*GB, (g+1)*GB)`` of the stream whatever the layout). *Per-row* state belongs to
rows of the global batch: the model's carry, one tensor per micro-batch slot with the slot's
rows on dim 0 (``NAME.SLOT`` keys; slot ``s`` of a rank training rows ``[start, stop)`` holds
rows ``start + s*mb ... start + (s+1)*mb - 1``).

The mapping is keyed by those global rows only, never by the number of processes or by mesh
dimensions, just as DCP reshards the model and optimizer tensors by name and global shape: any
layout whose ranks say which rows they train (``state.layout["rows"]``) maps the same way. RNG
is not mapped: the trainer re-derives every generator from (seed, step) before each step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kiln.checkpointing import payload, storage
from kiln.components.errors import CheckpointError

_CARRY_KEY = re.compile(r"^(.+)\.(0|[1-9][0-9]*)$")
HEADER_KEYS = frozenset({"rank", "world_size", "rng", "payload", "loader", "batch"})


def check_header(header: dict, where: str) -> None:
    """A rank file's header has exactly kiln's fields (``batch`` is absent in files written
    before elastic resume)."""
    if set(header) not in (HEADER_KEYS, HEADER_KEYS - {"batch"}):
        raise CheckpointError(f"{where}: malformed rank state header {sorted(header)}")


@dataclass(frozen=True)
class Rows:
    """The global-batch rows one rank trains, in micro-batches (slots) of ``micro_batch``."""

    start: int
    stop: int
    micro_batch: int

    def slot_start(self, slot: int) -> int:
        return self.start + slot * self.micro_batch

    @property
    def slots(self) -> int:
        return (self.stop - self.start) // self.micro_batch

    def __str__(self) -> str:
        return f"rows {self.start}-{self.stop - 1} (micro-batches of {self.micro_batch})"


def rows_of(batch: dict | None) -> Rows | None:
    """``{"rows": [start, stop], "micro_batch": mb}`` (a layout or a rank-file header) -> Rows."""
    if not isinstance(batch, dict) or "rows" not in batch:
        return None
    (start, stop), mb = batch["rows"], batch["micro_batch"]
    if not (type(start) is int and type(stop) is int and type(mb) is int and 0 <= start < stop
            and mb > 0 and (stop - start) % mb == 0):
        raise CheckpointError(f"malformed batch rows {batch!r}")
    return Rows(start, stop, mb)


def batch_header(layout: dict | None) -> dict | None:
    """What a rank file records about the rows it trained (None: the state has no layout)."""
    if not layout:
        return None
    return {"rows": list(layout["rows"]), "micro_batch": int(layout["micro_batch"])}


@dataclass
class Mapped:
    payload: dict[str, Any]
    loader: Any
    notes: list[str] = field(default_factory=list)


def map_rank_state(folder: Path, files: list[Path], step: int, target: Rows,
                   guard_names: set[str]) -> Mapped:
    """This rank's payload and loader cursor, assembled from the saved rank files."""
    saved: list[tuple[Path, Rows, dict]] = []
    for path in files:
        header = storage.read_rank_header(path)
        check_header(header, str(path))
        rows = rows_of(header.get("batch"))
        if rows is None:
            raise CheckpointError(
                f"{path}: this checkpoint does not record which batch rows each process trained "
                f"(written before elastic resume); resume it with {len(files)} processes and "
                "the same micro_batch"
            )
        saved.append((path, rows, header))
    source = next((s for s in saved if s[1].start <= target.start < s[1].stop), None)
    if source is None:
        raise CheckpointError(f"{folder}: no saved process trained global batch row "
                              f"{target.start}; did training.global_batch change?")
    path, src_rows, header = source
    pay = {**header["payload"], "carry": None}
    payload.validate(pay, expected_step=step, guard_names=guard_names, where=str(path))
    notes = [f"data cursor and guard state: from {path.name} (global: the same on every rank); "
             f"this rank continues with {target}"]
    if header["payload"].get("carry") is not None:
        carry, missing, used = regroup_carry(
            [(p, r, h["payload"].get("carry") or []) for p, r, h in saved], target)
        pay["carry"] = carry
        note = (f"carry: {target.stop - target.start} rows regrouped by global batch row from "
                f"{', '.join(sorted(used))} into {target.slots} slots of {target.micro_batch}")
        if missing:
            note += f"; slots {missing} start fresh (their rows were not all carried)"
        notes.append(note)
    payload.validate(pay, expected_step=step, guard_names=guard_names, where=str(path))
    return Mapped(pay, header["loader"], notes)


def regroup_carry(saved: list[tuple[Path, Rows, list[str]]], target: Rows
                  ) -> tuple[dict[str, torch.Tensor], list[int], set[str]]:
    """Carry tensors for ``target``'s slots from the saved ranks' slots, by global row.

    Returns (carry, target slots left out because some row was not saved, files read)."""
    where: dict[str, dict[int, tuple[Path, str, int]]] = {}  # name -> row -> (file, key, index)
    for path, rows, keys in saved:
        if rows.stop <= target.start or rows.start >= target.stop:
            continue  # no row of ours: the file is not opened
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
            for key in keys:
                m = _CARRY_KEY.match(key)
                if m is None or payload.CARRY_PREFIX + key not in present:
                    raise CheckpointError(f"{path}: carry entry {key!r} is missing or not "
                                          "NAME.SLOT; the checkpoint was edited")
                first = rows.slot_start(int(m.group(2)))
                n = f.get_slice(payload.CARRY_PREFIX + key).get_shape()[0]
                for i in range(n):
                    where.setdefault(m.group(1), {})[first + i] = (path, key, i)
    cache: dict[tuple[Path, str], torch.Tensor] = {}
    carry, missing, used = {}, [], set()
    for slot in range(target.slots):
        want = range(target.slot_start(slot), target.slot_start(slot) + target.micro_batch)
        if not where or any(r not in rows for rows in where.values() for r in want):
            missing.append(slot)
            continue
        for name, rows in where.items():
            parts = []
            for r in want:
                path, key, i = rows[r]
                used.add(path.name)
                if (path, key) not in cache:
                    with safe_open(str(path), framework="pt") as f:
                        cache[path, key] = f.get_tensor(payload.CARRY_PREFIX + key)
                parts.append(cache[path, key][i:i + 1])
            carry[f"{name}.{slot}"] = torch.cat(parts)
    return carry, missing, used


def describe_change(saved: dict | None, current: dict | None) -> list[str]:
    """Report lines: how the layout changed (generic over the layout's keys and mesh dims);
    empty when nothing changed or a side does not record its layout."""
    if not saved or not current:
        return []

    def shape(lay: dict) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in lay.get("mesh", {}).items())
        dims = lay.get("mesh", {})
        data_parallel = dims.get("dp_replicate", 1) * dims.get("dp_shard", 1)
        mode = "FSDP" if lay.get("fsdp") else "replicated" if data_parallel > 1 else ""
        n = lay["world_size"]
        return ", ".join(x for x in (f"{n} process{'es' if n > 1 else ''}", mesh, mode) if x)

    lines = []
    if shape(saved) != shape(current):
        lines.append(f"layout: {shape(saved)} -> {shape(current)}; model and optimizer state "
                     "resharded by DCP (matched by name and global shape)")
    for key in ("micro_batch", "grad_accum"):
        if saved.get(key) != current.get(key):
            lines.append(f"{key}: {saved.get(key)} -> {current.get(key)} per rank (the same "
                         f"global batch of {current.get('global_batch')} rows: the same stream)")
    return lines

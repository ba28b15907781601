"""A preference step's reference log-probabilities, computed once and kept with the run
(``training.step.precompute_reference``), as TRL's ``precompute_ref_log_probs`` does, but
stored: a resumed run reads them instead of computing them again.

Before the first step every data-parallel rank computes the reference's summed completion
log-probability of its share of each split's pairs (pair ``i`` on rank ``i % ranks``; every
rank runs the same number of forwards, as FSDP2 needs), and one all-reduce gives every rank
the whole table: (pairs, 2) per split, chosen then rejected. The first step's end writes it to
``RUN/reference_logps.safetensors`` (written aside, then renamed), with what it was computed
from (the data's fingerprint, the reference); a resume reads it and checks both. A batch's
``pair_ids`` look the values up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kiln.components import distributed
from kiln.components.errors import CheckpointError

FILE = "reference_logps.safetensors"
SPLITS = ("train", "eval")


class Stored:
    """The table of each split, and where it goes."""

    def __init__(self, tables: dict[str, torch.Tensor], meta: dict[str, str], path: Path,
                 write: bool) -> None:
        self.tables, self.meta, self.path, self._write = tables, meta, path, write

    def lookup(self, split: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(2n,) the rows' reference log-probabilities: the chosen rows', then the rejected."""
        ids = batch["pair_ids"].cpu()
        n = ids.shape[0] // 2
        table = self.tables[split]
        return torch.cat([table[ids[:n], 0], table[ids[n:], 1]])

    def save_once(self) -> None:
        if not self._write:
            return
        self._write = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        save_file({k: v.contiguous() for k, v in self.tables.items()}, str(tmp),
                  metadata={"kiln": json.dumps(self.meta)})
        os.replace(tmp, self.path)


def _meta(step, build) -> dict[str, str]:
    return {"data": json.dumps(build.dataset.fingerprints(), sort_keys=True),
            "reference": step.uses}


def load(step, build) -> Stored | None:
    """The run folder's table (a resumed run), checked against this data and reference; None
    when there is none yet."""
    path = Path(build.run_dir) / FILE
    if not path.is_file():
        return None
    meta = _meta(step, build)
    tables = _read(path, meta, build.dataset)
    build.lines.append(f"step: the reference's log-probabilities from {path} (computed when "
                       "the run started)")
    return Stored(tables, meta, path, write=False)


def compute(step, build) -> Stored:
    """Every pair's reference log-probabilities, computed now with the step's reference
    (``step.reference_logprobs``); written to the run folder as the first step ends."""
    path = Path(build.run_dir) / FILE
    tables = {split: _compute(step, build, split) for split in SPLITS}
    counts = ", ".join(f"{len(t)} {split}" for split, t in tables.items())
    build.lines.append(f"step: the reference's log-probabilities of every pair computed once "
                       f"({counts} pairs); kept in {path} from the first step")
    return Stored(tables, _meta(step, build), path, write=build.is_main)


def _read(path: Path, meta: dict[str, str], dataset) -> dict[str, torch.Tensor]:
    try:
        tables = load_file(str(path))
        with safe_open(str(path), framework="pt") as f:
            saved = json.loads((f.metadata() or {}).get("kiln", "{}"))
    except (OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc}); delete it to compute the "
                              "reference's log-probabilities again") from None
    for key, what in (("data", "data"), ("reference", "reference")):
        if saved.get(key) != meta[key]:
            raise CheckpointError(
                f"{path}: computed for other {what} ({saved.get(key)!r}, this run: "
                f"{meta[key]!r}); a resume must keep the data and the reference: restore "
                "them, or delete the file to compute it again")
    for split in SPLITS:
        if split not in tables or tables[split].shape != (dataset.pair_count(split), 2):
            raise CheckpointError(f"{path}: no table of the {split} split's "
                                  f"{dataset.pair_count(split)} pairs; delete it to compute "
                                  "the reference's log-probabilities again")
    return tables


def _compute(step, build, split: str) -> torch.Tensor:
    """(pairs, 2) float32 on the CPU, the same on every rank."""
    n, per = build.dataset.pair_count(split), step.cfg.precompute_micro_batch
    table = torch.zeros(n, 2, dtype=torch.float32, device=build.device)
    mine = np.arange(build.rank, n, build.ranks)
    most = -(-n // build.ranks)  # pairs of the rank with the most
    rounds = -(-most // per)  # the same on every rank
    context = _Context(build)
    for r in range(rounds):
        ids = mine[r * per:(r + 1) * per]
        take = len(ids)
        if take == 0:  # this rank is out of pairs: a forward all the same (FSDP2)
            ids = np.zeros(1, dtype=np.int64)
        batch = build.dataset.pair_batch(split, ids)
        ref = step.reference_logprobs(context, batch, split).float()
        if take:
            at = torch.as_tensor(ids, device=build.device)
            table[at, 0], table[at, 1] = ref[:take], ref[take:]
    step.reference_forwards = 0  # (counted: the training's own from here)
    distributed.all_reduce_(table)
    return table.cpu()


class _Context:
    """What ``reference_logprobs`` needs of a step context, before the first step."""

    def __init__(self, build) -> None:
        self.model, self.device, self._build = build.policy, build.device, build

    def token_logprobs(self, batch, model=None, **kw):
        return self._build.token_logprobs(batch, model, **kw)

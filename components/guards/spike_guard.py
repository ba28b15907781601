"""The loss-spike guard: skip an optimizer step on non-finite values or a loss jump.

Decisions use the step's global statistics (the loss averaged over ranks, the norm of the
synchronised gradients), so every rank decides the same without a collective of its own, and
the guard never touches a tensor (the trainer's single host sync produced the floats).

A jump is measured against an EMA of accepted losses, kept per segment of a segmented step
(early loop segments naturally have a higher loss than late ones; one shared baseline made
every early segment look like a spike). A segment's first observation is accepted (cold
start). A step is skipped when, with ``d = loss - baseline``:
``d >= hard`` or ``loss >= baseline * (1 + ratio)`` or ``d >= max(delta_floor, rel * baseline)``.
A rejected loss never enters the baseline. Training aborts (alarm file in the run folder, then
``TrainingAborted``, exit status 2, before anything is saved) on the first skip if
``abort_on_spike``, or when ``abort_consecutive`` global steps in a row had a skipped segment.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.errors import CheckpointError
from kiln.components.registry import register
from kiln.components.steps.common import GuardDecision

STATE_VERSION = 1
_COUNTERS = ("skips_total", "spikes_total", "nonfinite_total", "consecutive_skipped_steps")


class SpikeGuardConfig(ComponentConfig):
    finite_keys: list[str] = Field(
        default_factory=lambda: ["loss", "grad_norm"],
        description="statistics that must be finite (a missing one is not checked)",
    )
    loss_key: str = Field("loss", description="the statistic compared with its baseline")
    delta_floor: float = Field(
        0.2, ge=0, description="absolute floor of the adaptive jump threshold"
    )
    rel: float = Field(
        0.06, ge=0, description="adaptive threshold = max(delta_floor, rel * baseline)"
    )
    ratio: float = Field(
        0.09, ge=0, description="skip if loss >= baseline * (1 + ratio) (0 = off)"
    )
    hard: float = Field(1.5, ge=0, description="skip if loss - baseline >= hard (0 = off)")
    ema: float = Field(
        0.9, ge=0, lt=1, description="EMA factor of the baseline (0 = last accepted loss)"
    )
    warmup_steps: int = Field(
        0, ge=0, description="steps with only the non-finite checks (early loss is noisy)"
    )
    abort_on_spike: bool = Field(False, description="abort training at the first skipped step")
    abort_consecutive: int = Field(
        0, ge=0, description="abort after this many consecutive steps with a skip (0 = off)"
    )
    events_file: str = Field(
        "spike_events.jsonl", description="skip events, one JSON line each, in the run folder"
    )
    alarm_file: str = Field("SPIKE_ABORT.json", description="written in the run folder on abort")


def _finite_number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


@register("guard", "spike_guard")
class SpikeGuard:
    """Skips steps with non-finite loss/gradients or loss spikes; can abort the run."""

    Config = SpikeGuardConfig

    def __init__(self, cfg: SpikeGuardConfig, *, run_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.baseline: dict[int, float] = {}  # segment -> EMA of accepted losses
        self.counters = dict.fromkeys(_COUNTERS, 0)
        self.current_step = -1  # the step the counters below refer to
        self.step_had_skip = False
        self.aborted = False
        self.last_reason: str | None = None

    # ------------------------------------------------------------------------- decisions
    def decide(self, stats: dict[str, float], step: int, segment: int) -> GuardDecision:
        skip, reason = self._check(stats, step, segment)
        if not skip:
            return GuardDecision()
        consec = self._consecutive_after_skip(step)
        limit = self.cfg.abort_consecutive
        abort = self.cfg.abort_on_spike or (limit > 0 and consec >= limit)
        if abort and not self.cfg.abort_on_spike:
            reason = f"{reason}; {consec} consecutive skipped steps (limit {limit})"
        return GuardDecision(skip=True, abort=abort, reason=reason)

    def _check(self, stats: dict[str, float], step: int, segment: int) -> tuple[bool, str]:
        for key in self.cfg.finite_keys:
            v = stats.get(key)
            if v is not None and not math.isfinite(v):
                return True, f"nonfinite_{key}={v}"
        loss = stats.get(self.cfg.loss_key)
        if loss is None or step < self.cfg.warmup_steps or not math.isfinite(loss):
            return False, ""
        base = self.baseline.get(segment)
        if base is None:  # cold start of this segment: accept the first observation
            return False, ""
        d = loss - base
        tag = f"seg{segment}"
        if self.cfg.hard and d >= self.cfg.hard:
            return True, f"hard: loss {loss:.4f} - baseline {base:.4f} >= {self.cfg.hard} ({tag})"
        if self.cfg.ratio and base > 0 and loss >= base * (1 + self.cfg.ratio):
            return True, (f"ratio: loss {loss:.4f} >= baseline {base:.4f} x "
                          f"{1 + self.cfg.ratio:g} ({tag})")
        thr = max(self.cfg.delta_floor, self.cfg.rel * max(base, 0.0))
        if thr > 0 and d >= thr:
            return True, f"jump: loss {loss:.4f} - baseline {base:.4f} >= {thr:.4f} ({tag})"
        return False, ""

    def _consecutive_after_skip(self, step: int) -> int:
        """The consecutive-skipped-steps count if ``step`` skips now."""
        if step == self.current_step:
            c = self.counters["consecutive_skipped_steps"]
            return c if self.step_had_skip else c + 1
        # A new step: the run of skipped steps continues only if the previous step skipped.
        c = self.counters["consecutive_skipped_steps"] if self.step_had_skip else 0
        return c + 1

    def commit(self, decision: GuardDecision, stats: dict[str, float], step: int,
               segment: int) -> None:
        """Record the decision (possibly another guard's): counters, baseline, events."""
        if step != self.current_step:
            if not self.step_had_skip:
                self.counters["consecutive_skipped_steps"] = 0
            self.current_step, self.step_had_skip = step, False
        loss = stats.get(self.cfg.loss_key)
        if not decision.skip:
            if loss is not None and math.isfinite(loss):
                old = self.baseline.get(segment)
                a = self.cfg.ema
                self.baseline[segment] = loss if old is None else a * old + (1 - a) * loss
            return
        self.counters["skips_total"] += 1
        kind = "nonfinite_total" if decision.reason.startswith("nonfinite") else "spikes_total"
        self.counters[kind] += 1
        if not self.step_had_skip:
            self.counters["consecutive_skipped_steps"] += 1
            self.step_had_skip = True
        self.last_reason = decision.reason
        record = {
            "step": step, "segment": segment, "reason": decision.reason,
            "loss": loss, "baseline": self.baseline.get(segment),
            "grad_norm": stats.get("grad_norm"), "abort": decision.abort,
            **self.counters, "time": round(time.time(), 3),
        }
        self._write_event(record)
        if decision.abort:
            self.aborted = True
            self._write_alarm(record)

    # --------------------------------------------------------------------------- outputs
    def metrics(self) -> dict[str, float]:
        out = {f"guard/{k}": float(v) for k, v in self.counters.items()}
        out.update({f"guard/baseline_seg{s}": b for s, b in sorted(self.baseline.items())})
        return out

    def _main_rank(self) -> bool:
        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    def _write_event(self, record: dict[str, Any]) -> None:
        if self.run_dir is None or not self.cfg.events_file or not self._main_rank():
            return
        path = self.run_dir / self.cfg.events_file
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(_jsonable(record), sort_keys=True) + "\n")

    def _write_alarm(self, record: dict[str, Any]) -> None:
        if self.run_dir is None or not self.cfg.alarm_file or not self._main_rank():
            return
        path = self.run_dir / self.cfg.alarm_file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(_jsonable(record), indent=2, sort_keys=True) + "\n",
                       encoding="utf-8")
        os.replace(tmp, path)  # never a half-written alarm

    # ------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "baseline": {str(s): float(b) for s, b in sorted(self.baseline.items())},
            **dict(self.counters),
            "current_step": self.current_step,
            "step_had_skip": self.step_had_skip,
            "aborted": self.aborted,
            "last_reason": self.last_reason,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        """Restore a saved state; every field is checked before anything changes."""
        valid = _validate_state(d)
        self.baseline = valid["baseline"]
        self.counters = {k: valid[k] for k in _COUNTERS}
        self.current_step = valid["current_step"]
        self.step_had_skip = valid["step_had_skip"]
        self.aborted = valid["aborted"]
        self.last_reason = valid["last_reason"]


_FIELDS = frozenset({"version", "baseline", *_COUNTERS, "current_step", "step_had_skip",
                     "aborted", "last_reason"})


def _validate_state(d: Any) -> dict[str, Any]:
    def bad(what: str) -> CheckpointError:
        return CheckpointError(
            f"spike_guard state: {what}; the checkpoint is corrupt or from another kiln "
            "version (resume with checkpoint.weights_only = true to start fresh guard history)"
        )

    if not isinstance(d, dict) or set(d) != _FIELDS:
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise bad(f"fields {got}, expected exactly {sorted(_FIELDS)}")
    if type(d["version"]) is not int or d["version"] != STATE_VERSION:
        raise bad(f"version {d['version']!r} (this kiln reads {STATE_VERSION})")
    base = d["baseline"]
    if not isinstance(base, dict):
        raise bad("baseline must map segment numbers to losses")
    baseline = {}
    for key, value in base.items():
        if not (isinstance(key, str) and key.isdecimal() and str(int(key)) == key):
            raise bad(f"baseline key {key!r} is not a segment number")
        if not _finite_number(value):
            raise bad(f"baseline[{key}] = {value!r} is not a finite number")
        baseline[int(key)] = float(value)
    for key in _COUNTERS:
        if type(d[key]) is not int or d[key] < 0:
            raise bad(f"{key} = {d[key]!r} is not a non-negative integer")
    if type(d["current_step"]) is not int or d["current_step"] < -1:
        raise bad(f"current_step = {d['current_step']!r} is not an integer >= -1")
    for key in ("step_had_skip", "aborted"):
        if type(d[key]) is not bool:
            raise bad(f"{key} = {d[key]!r} is not a boolean")
    if d["last_reason"] is not None and not isinstance(d["last_reason"], str):
        raise bad(f"last_reason = {d['last_reason']!r} is not a string or null")
    return {**d, "baseline": baseline}


def _jsonable(record: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf as strings: JSON has no non-finite numbers."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in record.items()}

"""The looped model's carried state and its loop windows.

Carry: after the last loop of a training step, each micro-batch row's state (B, T, dim) is
kept and becomes s_0 of the same row (same micro-batch index, same rank) in the next step. It is
staged during the forward and committed only after a *successful* optimizer step (a skipped
step may have produced non-finite states; the previous carry is kept).

Resets, per row: the first use (or a changed batch shape), ``carry_max_steps`` steps of
carrying, or — the document signal the packed batches give — the row's previous window
contained ``carry_reset_token`` (e.g. EOS: its document ended). In kiln's packed layout a row's
next window is ``global_batch`` windows further down the stream, not the continuation of its
text, so the carry is a warm start of the latent rather than a recurrent memory of the same
document; ``carry_max_steps`` bounds how stale it gets. (The reference trainer passes its carry
from micro-batch to micro-batch and starts segmented steps from a fresh state.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from kiln.components.errors import CheckpointError


@dataclass
class LoopWindow:
    """Loops [start, stop) of one micro-batch forward; the step reads ``state_out``."""

    start: int
    stop: int
    slot: int
    state_in: torch.Tensor | None
    state_out: torch.Tensor | None = None


_KEY = re.compile(r"^(state|age|ended)\.(0|[1-9][0-9]*)$")


class Carry:
    """Per-slot (micro-batch index) carried states, ages and document-ended flags."""

    def __init__(self, cfg) -> None:
        self.max_steps = cfg.carry_max_steps
        self.reset_token = cfg.carry_reset_token
        self.state: dict[int, torch.Tensor] = {}  # slot -> (B, T, dim), detached
        self.age: dict[int, torch.Tensor] = {}  # slot -> (B,) int64, steps carried so far
        self.ended: dict[int, torch.Tensor] = {}  # slot -> (B,) bool, document ended
        self._reset: dict[int, torch.Tensor] = {}  # rows started fresh in this step
        self._pending: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.last_reset_fraction = 0.0

    def initial(self, slot: int, fresh: torch.Tensor) -> torch.Tensor:
        """s_0 of ``slot``: the carried rows, ``fresh`` rows where a reset is due."""
        b = fresh.shape[0]
        old = self.state.get(slot)
        if old is None or old.shape != fresh.shape:
            self._reset[slot] = torch.ones(b, dtype=torch.bool, device=fresh.device)
            return fresh
        reset = self.ended[slot].to(fresh.device)
        if self.max_steps:
            reset = reset | (self.age[slot].to(fresh.device) >= self.max_steps)
        self._reset[slot] = reset
        return torch.where(reset[:, None, None], fresh, old.to(fresh.device, fresh.dtype))

    def stage(self, slot: int, s: torch.Tensor, ids: torch.Tensor) -> None:
        """Remember the final state of ``slot`` until the step's optimizer decision."""
        b = s.shape[0]
        reset = self._reset.get(slot)
        if reset is None:
            reset = torch.ones(b, dtype=torch.bool, device=s.device)
        prev = self.age.get(slot)
        prev = prev.to(s.device) if prev is not None and prev.shape == (b,) else torch.zeros(
            b, dtype=torch.int64, device=s.device)
        age = torch.where(reset, torch.zeros_like(prev), prev) + 1
        if self.reset_token >= 0:
            ended = (ids == self.reset_token).any(1)
        else:
            ended = torch.zeros(b, dtype=torch.bool, device=s.device)
        self._pending[slot] = (s.detach(), age, ended)

    def commit(self, skipped: bool) -> None:
        """After an optimizer step: keep the staged states, or drop them on a skip. A segment
        before the last stages nothing; its step leaves the step's reset rows in place."""
        if not skipped and not self._pending:
            return
        if not skipped:
            resets = [self._reset[s].float().mean() for s in self._pending if s in self._reset]
            if resets:
                self.last_reset_fraction = float(torch.stack(resets).mean())
            for slot, (s, age, ended) in self._pending.items():
                self.state[slot], self.age[slot], self.ended[slot] = s, age, ended
        self._pending.clear()
        self._reset.clear()

    def metrics(self) -> dict[str, float]:
        out = {"carry/reset_fraction": self.last_reset_fraction}
        if self.age:
            out["carry/mean_age"] = float(torch.cat(list(self.age.values())).float().mean())
        return out

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {}
        for slot in sorted(self.state):
            out[f"state.{slot}"] = self.state[slot]
            out[f"age.{slot}"] = self.age[slot]
            out[f"ended.{slot}"] = self.ended[slot]
        return out

    def load_state_dict(self, d: dict[str, torch.Tensor]) -> None:
        """Restore saved slots exactly; everything is checked before anything changes."""
        slots: dict[int, dict[str, torch.Tensor]] = {}
        for key, value in d.items():
            m = _KEY.match(key) if isinstance(key, str) else None
            if m is None or not isinstance(value, torch.Tensor):
                raise CheckpointError(f"carry: unexpected entry {key!r}; expected "
                                      "state.N / age.N / ended.N tensors")
            slots.setdefault(int(m.group(2)), {})[m.group(1)] = value
        for slot, parts in slots.items():
            if set(parts) != {"state", "age", "ended"}:
                raise CheckpointError(f"carry slot {slot} is incomplete: has {sorted(parts)}")
            st, age, ended = parts["state"], parts["age"], parts["ended"]
            b = st.shape[0] if st.dim() == 3 else -1
            if (not st.is_floating_point() or st.dim() != 3 or age.dtype != torch.int64
                    or ended.dtype != torch.bool or age.shape != (b,) or ended.shape != (b,)):
                raise CheckpointError(
                    f"carry slot {slot}: expected state (B, T, dim) float, age (B,) int64, "
                    f"ended (B,) bool; got {tuple(st.shape)} {st.dtype}, {tuple(age.shape)} "
                    f"{age.dtype}, {tuple(ended.shape)} {ended.dtype}"
                )
            if not bool(torch.isfinite(st).all()):
                raise CheckpointError(f"carry slot {slot} has non-finite values")
        self.state = {s: p["state"] for s, p in slots.items()}
        self.age = {s: p["age"] for s, p in slots.items()}
        self.ended = {s: p["ended"] for s, p in slots.items()}
        self._pending.clear()
        self._reset.clear()

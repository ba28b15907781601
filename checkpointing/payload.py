"""The runtime payload: ``{version, step, carry, guard_fields}``, validated strictly on load.

``carry`` is the model's carried latent state (``model.carry_state()``: a dict of tensors, or None
for models without one); ``guard_fields`` maps each guard's name to its JSON-able
``state_dict()``. Tensors travel in the rank's safetensors file, the rest as JSON. Loading checks
the exact field set, every type, that numbers are finite, that the step equals the train
progress step, that the version is known, and refuses a full resume when a guard's state says
training was aborted (``"aborted": true``), as the looped-MoE reference does.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.components.errors import CheckpointError

VERSION = 1
FIELDS = frozenset({"version", "step", "carry", "guard_fields"})
CARRY_PREFIX = "carry."


def capture(step: int, model: torch.nn.Module, guards: dict[str, Any]) -> dict[str, Any]:
    """The payload of this rank now (carry tensors detached and on the CPU)."""
    carry_fn = getattr(model, "carry_state", None)
    carry = carry_fn() if carry_fn is not None else None
    if carry is not None:
        carry = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in carry.items()}
    payload = {
        "version": VERSION,
        "step": int(step),
        "carry": carry,
        "guard_fields": {name: g.state_dict() for name, g in guards.items()},
    }
    return validate(payload, expected_step=int(step), guard_names=set(guards), where="save")


def split(payload: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON header) for the rank file; the header lists the carry's keys."""
    carry = payload["carry"]
    tensors = {CARRY_PREFIX + k: v for k, v in (carry or {}).items()}
    header = {**payload, "carry": None if carry is None else sorted(carry)}
    return tensors, header


def join(tensors: dict[str, torch.Tensor], header: Any, where: str) -> dict[str, Any]:
    """Rebuild the payload from the rank file's tensors and JSON header (not yet validated)."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{where}: runtime payload is not a JSON object")
    keys = header.get("carry")
    carry_tensors = {k[len(CARRY_PREFIX):]: v for k, v in tensors.items()
                     if k.startswith(CARRY_PREFIX)}
    if keys is None:
        if carry_tensors:
            raise CheckpointError(f"{where}: carry tensors present but the payload says none")
        carry = None
    else:
        if not isinstance(keys, list) or sorted(carry_tensors) != sorted(keys):
            raise CheckpointError(
                f"{where}: carry tensors {sorted(carry_tensors)} do not match the payload's "
                f"list {keys}; the checkpoint is incomplete or was edited"
            )
        carry = carry_tensors
    return {**header, "carry": carry}


def validate(payload: Any, *, expected_step: int, guard_names: set[str] | None,
             where: str) -> dict[str, Any]:
    """Return the payload if it is exactly what kiln writes; raise CheckpointError otherwise."""
    def bad(what: str) -> CheckpointError:
        return CheckpointError(f"{where}: invalid runtime payload: {what}")

    if not isinstance(payload, dict) or set(payload) != FIELDS:
        got = sorted(payload) if isinstance(payload, dict) else type(payload).__name__
        raise bad(f"fields {got}, expected {sorted(FIELDS)}")
    if type(payload["version"]) is not int or payload["version"] != VERSION:
        raise bad(f"version {payload['version']!r} is not supported (this kiln reads {VERSION})")
    step = payload["step"]
    if type(step) is not int or step < 0 or step != expected_step:
        raise bad(f"step {step!r} does not match the train progress step {expected_step}")
    carry = payload["carry"]
    if carry is not None:
        if not isinstance(carry, dict) or not all(isinstance(k, str) for k in carry):
            raise bad("carry must be None or a dict of named tensors")
        for k, v in carry.items():
            if not isinstance(v, torch.Tensor):
                raise bad(f"carry[{k!r}] is a {type(v).__name__}, not a tensor")
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise bad(f"carry[{k!r}] has non-finite values")
    fields = payload["guard_fields"]
    if not isinstance(fields, dict) or not all(isinstance(k, str) for k in fields):
        raise bad("guard_fields must map guard names to their states")
    if guard_names is not None and set(fields) != set(guard_names):
        raise bad(
            f"guards in the checkpoint {sorted(fields)} differ from the recipe's "
            f"{sorted(guard_names)}; keep the same [guards.NAME] tables to resume exactly, or "
            "set checkpoint.weights_only = true to start fresh guard history"
        )
    for name, state in fields.items():
        if not isinstance(state, dict):
            raise bad(f"guard {name!r}: state must be a JSON object")
        _check_json(state, f"guard_fields.{name}", bad)
    return payload


def aborted_guards(payload: dict[str, Any]) -> list[str]:
    """Names of guards whose state says training was aborted (a terminal state)."""
    return [n for n, s in payload["guard_fields"].items() if s.get("aborted") is True]


def _check_json(value: Any, path: str, bad) -> None:
    if value is None or type(value) in (bool, int, str):
        return
    if type(value) is float:
        if not math.isfinite(value):
            raise bad(f"{path} = {value} is not finite")
        return
    if isinstance(value, list):
        for i, v in enumerate(value):
            _check_json(v, f"{path}[{i}]", bad)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise bad(f"{path} has a non-string key {k!r}")
            _check_json(v, f"{path}.{k}", bad)
        return
    raise bad(f"{path} has a {type(value).__name__}; guard state must be plain JSON")

"""The JSON part of a checkpoint's model and optimizer state when ranks hold different
parameters (pipeline stages): each rank's part, merged into one for ``state.json``.

DCP saves every rank's tensors under their names; the rest (optimizer ``param_groups`` with the
parameter names they hold, non-tensor per-parameter state) is JSON written once by rank 0. With
FSDP2 or tensor parallel every rank lists the same names; a pipeline stage lists only its own, so
the ranks' parts are merged: dictionaries by key, parameter groups by name (their ``params``
lists joined in rank order, each name once). Identical parts merge to themselves.
"""

from __future__ import annotations

import copy
from typing import Any


def merge(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One JSON state from every rank's (rank 0's values win where both have a leaf)."""
    out = copy.deepcopy(parts[0])
    for other in parts[1:]:
        _merge_into(out, other)
    return out


def _merge_into(a: dict, b: dict) -> None:
    for key, value in b.items():
        if key not in a:
            a[key] = copy.deepcopy(value)
        elif key == "param_groups" and isinstance(value, list):
            a[key] = merge_groups(a[key], value)
        elif isinstance(value, dict) and isinstance(a[key], dict):
            _merge_into(a[key], value)


def merge_groups(a: list[dict], b: list[dict]) -> list[dict]:
    """Parameter groups of two ranks as one list: same-named groups joined."""
    out = copy.deepcopy(a)
    by_name = {g.get("name", i): g for i, g in enumerate(out)}
    for i, group in enumerate(b):
        key = group.get("name", i)
        if key not in by_name:
            out.append(copy.deepcopy(group))
            by_name[key] = out[-1]
            continue
        params = by_name[key].setdefault("params", [])
        params += [p for p in group.get("params", []) if p not in params]
    return out


def own_state(saved_state: dict[str, Any], names: set[str]) -> dict[str, Any]:
    """Per-parameter JSON state of the parameters this rank holds (by name)."""
    return {k: v for k, v in saved_state.items() if k in names}

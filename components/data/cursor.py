"""Checking a saved data-loader cursor (a loader's ``state_dict``) before it is loaded.

A checkpoint's cursor is JSON a user can edit, so each loader describes the cursor it writes as
a strict pydantic model and checks a saved one against it (``check_cursor``): a missing field,
a wrong type or an unknown key is one ``DataError`` naming the field, raised by the loader's
``check_state_dict`` -- which the checkpoint manager calls with the rest of the rank's saved
state, before any model or optimizer tensor is read.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, ValidationError

from kiln.components.errors import DataError


class Cursor(BaseModel):
    """Base of the cursor models: exact field set, JSON types, no coercion."""

    model_config = ConfigDict(strict=True, extra="forbid")


class PlanCursor(Cursor):
    """The batch plan a cursor was saved with (a loader compares it with its own)."""

    seq_len: PositiveInt
    global_batch: PositiveInt
    micro_batch: PositiveInt
    world_size: PositiveInt


class StepCursor(PlanCursor):
    """A position counted in global steps and micro-batches of the step."""

    step: NonNegativeInt
    micro: NonNegativeInt


def check_cursor(model: type[Cursor], state: Any) -> None:
    """Raise DataError unless ``state`` is exactly the cursor ``model`` describes. Validated as
    JSON text, the form it was saved in (strict mode then reads JSON arrays as tuples)."""
    try:
        model.model_validate_json(json.dumps(state, allow_nan=False))
    except (TypeError, ValueError) as exc:  # ValidationError is a ValueError
        if isinstance(exc, ValidationError):
            first = exc.errors()[0]
            field = ".".join(str(p) for p in first["loc"]) or "the cursor itself"
            what = f"{field}: {first['msg']}"
        else:
            what = f"not plain JSON ({exc})"
        raise DataError(
            f"malformed data loader cursor ({what}); it was edited or written by another kind "
            "of loader: resume from another checkpoint, or start the data from the beginning "
            "with checkpoint.weights_only = true"
        ) from None

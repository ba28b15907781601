"""Preference pairs from rows: a prompt, a chosen and a rejected completion, checked.

The row formats are TRL's "preference" ones. Explicit prompt: ``prompt`` (text, or a list of
messages) with ``chosen`` and ``rejected`` (text: one assistant turn; or a list of assistant
messages). Implicit prompt: ``chosen`` and ``rejected`` are whole conversations (lists of
messages); the prompt is every message before the trailing assistant turns, and it must be
the same on both sides. ``fields`` maps ``prompt`` / ``chosen`` / ``rejected`` / ``system``
to the row's own names (a dotted path; for a text prompt or system also a format string, as
the chat data's). Unpaired rows (TRL's "unpaired preference", for KTO) hold ``prompt``,
``completion`` and a boolean ``label`` (desirable or not) instead of the two sides. Every
error names the file and the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.components.data.chat import conversations
from kiln.components.data.chat.conversations import Message
from kiln.components.errors import DataError
from kiln.components.fields import value

SIDES = ("chosen", "rejected")


@dataclass(frozen=True)
class Pair:
    """One preference example: the prompt's messages and each side's completion messages."""

    prompt: list[Message]
    chosen: list[Message]
    rejected: list[Message]


def to_pair(row: dict, fields: dict[str, str], where: str) -> Pair:
    """The row's pair, checked (``check``)."""
    sides = {side: _side(row, fields.get(side, side), side, where) for side in SIDES}
    prompt_key = fields.get("prompt", "prompt")
    if "prompt" in fields or _has(row, prompt_key):
        prompt = conversations.prompt_messages(row, fields, where)
        completions = {s: _completion(v, s, where) for s, v in sides.items()}
    else:
        prompt, completions = _split_implicit(sides, where)
    pair = Pair(prompt, completions["chosen"], completions["rejected"])
    check(pair, where)
    return pair


def _has(row: dict, path: str) -> bool:
    try:
        value(row, path, "")
    except DataError:
        return False
    return True


def _side(row: dict, path: str, side: str, where: str) -> Any:
    if not _has(row, path):
        raise DataError(f"{where}: no {side!r} completion (field {path!r}); a preference row "
                        f"needs chosen and rejected (map them with data.fields.{side})")
    got = value(row, path, where)
    if not isinstance(got, (str, list)):
        raise DataError(f"{where}: {side} must be text or a list of messages, got "
                        f"{type(got).__name__}")
    return got


def _completion(got: Any, side: str, where: str) -> list[Message]:
    if isinstance(got, str):
        return [{"role": "assistant", "content": got}]
    messages = [conversations.message(m, f"{where}: {side}", i) for i, m in enumerate(got)]
    if not messages or messages[0]["role"] != "assistant":
        raise DataError(f"{where}: {side} must start with an assistant message (with an "
                        "explicit prompt, a completion is the assistant's turn)")
    return messages


def _split_implicit(sides: dict[str, Any], where: str) -> tuple[list[Message], dict]:
    """(the shared prompt, each side's trailing assistant turns) of whole conversations."""
    split = {}
    for side, got in sides.items():
        if isinstance(got, str):
            raise DataError(f"{where}: no prompt, and {side} is text; give a prompt field, or "
                            "chosen and rejected as whole conversations (lists of messages)")
        messages = [conversations.message(m, f"{where}: {side}", i) for i, m in enumerate(got)]
        cut = len(messages)
        while cut and messages[cut - 1]["role"] == "assistant":
            cut -= 1
        split[side] = (messages[:cut], messages[cut:])
    (prompt, chosen), (other, rejected) = split["chosen"], split["rejected"]
    if prompt != other:
        at = next((i for i, (a, b) in enumerate(zip(prompt, other, strict=False)) if a != b),
                  min(len(prompt), len(other)))
        raise DataError(f"{where}: the prompt differs between chosen and rejected (message "
                        f"{at}); both sides must continue the same conversation")
    return prompt, {"chosen": chosen, "rejected": rejected}


def check(pair: Pair, where: str) -> None:
    """One clear error for a pair that cannot be trained on: an empty side, chosen equal to
    rejected, or a conversation whose roles are out of order."""
    for side in SIDES:
        messages = getattr(pair, side)
        if not messages or not any(m["content"].strip() for m in messages):
            raise DataError(f"{where}: the {side} completion is empty; drop the row")
        conversations.check(pair.prompt + messages, f"{where}: {side}")
    if pair.chosen == pair.rejected:
        raise DataError(f"{where}: chosen equals rejected, so there is no preference to learn; "
                        "drop the row")


def is_unpaired(row: dict, fields: dict[str, str]) -> bool:
    """Whether a row is an unpaired example (a ``label``) rather than a pair."""
    return "label" in fields or "completion" in fields or _has(row, "label")


def to_unpaired(row: dict, fields: dict[str, str], where: str
                ) -> tuple[list[Message], list[Message], bool]:
    """(prompt, completion, desirable) of an unpaired row, checked."""
    label = value(row, fields.get("label", "label"), where)
    if not isinstance(label, bool):
        raise DataError(f"{where}: label must be true (desirable) or false, got {label!r}")
    got = _side(row, fields.get("completion", "completion"), "completion", where)
    prompt = conversations.prompt_messages(row, fields, where)
    completion = _completion(got, "completion", where)
    if not any(m["content"].strip() for m in completion):
        raise DataError(f"{where}: the completion is empty; drop the row")
    conversations.check(prompt + completion, where)
    return prompt, completion, label

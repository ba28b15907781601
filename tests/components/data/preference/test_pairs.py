"""Preference rows into pairs: TRL's explicit and implicit prompt formats, text or messages,
field mapping; each bad row is one error naming it."""

from __future__ import annotations

import pytest

from kiln.components.data.preference.pairs import Pair, to_pair
from kiln.components.errors import DataError

U = {"role": "user", "content": "What is 2 plus 3?"}
S = {"role": "system", "content": "Be terse."}


def _a(text):
    return {"role": "assistant", "content": text}


def test_explicit_prompt_as_text():
    pair = to_pair({"prompt": U["content"], "chosen": "5.", "rejected": "6."}, {}, "f: line 1")
    assert pair == Pair([U], [_a("5.")], [_a("6.")])


def test_explicit_prompt_as_messages_with_a_system_turn():
    row = {"prompt": [S, U], "chosen": [_a("5.")], "rejected": [_a("6.")]}
    assert to_pair(row, {}, "w") == Pair([S, U], [_a("5.")], [_a("6.")])


def test_implicit_prompt_is_what_precedes_the_trailing_assistant_turns():
    earlier = [U, _a("5."), {"role": "user", "content": "And times 2?"}]
    row = {"chosen": [*earlier, _a("10.")], "rejected": [*earlier, _a("12.")]}
    assert to_pair(row, {}, "w") == Pair(earlier, [_a("10.")], [_a("12.")])


def test_fields_map_dotted_paths_and_a_prompt_format_string():
    row = {"q": {"text": "2 plus 3"}, "ctx": "math", "good": "5.", "bad": "6.", "sys": "Be terse."}
    fields = {"prompt": "[{ctx}] {q.text}", "chosen": "good", "rejected": "bad",
              "system": "sys"}
    pair = to_pair(row, fields, "w")
    assert pair.prompt == [S, {"role": "user", "content": "[math] 2 plus 3"}]
    assert pair.chosen == [_a("5.")]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "rejected": "6."}, "no 'chosen' completion"),
    ({"prompt": "q", "chosen": "5."}, "no 'rejected' completion"),
    ({"prompt": "q", "chosen": "5.", "rejected": "5."}, "chosen equals rejected"),
    ({"prompt": "q", "chosen": "  ", "rejected": "6."}, "the chosen completion is empty"),
    ({"prompt": "q", "chosen": "5.", "rejected": ""}, "the rejected completion is empty"),
    ({"prompt": "q", "chosen": [U], "rejected": "6."}, "must start with an assistant"),
    ({"prompt": "q", "chosen": 5, "rejected": "6."}, "text or a list of messages"),
    ({"chosen": "5.", "rejected": "6."}, "no prompt, and chosen is text"),
    ({"chosen": [U, _a("5.")], "rejected": [{"role": "user", "content": "other"}, _a("6.")]},
     "the prompt differs between chosen and rejected \\(message 0\\)"),
    ({"chosen": [U, _a("5.")], "rejected": [S, U, _a("6.")]}, "prompt differs"),
    ({"prompt": [_a("hi")], "chosen": "5.", "rejected": "6."}, "roles out of order"),
])
def test_bad_rows_name_the_row_and_what_is_wrong(row, message):
    with pytest.raises(DataError, match=message) as err:
        to_pair(row, {}, "pairs.jsonl: line 7")
    assert str(err.value).startswith("pairs.jsonl: line 7")

"""Rows to conversations: the formats, field mapping, and one clear error per bad row."""

from __future__ import annotations

import json

import pytest

from kiln.components.data.chat.conversations import read_rows, to_messages
from kiln.components.errors import DataError


def _msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


def test_messages_prompt_completion_and_alpaca_fields():
    row = {"messages": _msgs(("user", "hi"), ("assistant", "hello"))}
    assert to_messages(row, {}, "r") == row["messages"]
    assert to_messages({"prompt": "q", "completion": "a"}, {}, "r") == \
        _msgs(("user", "q"), ("assistant", "a"))
    alpaca = {"instruction": "Add", "input": "2 and 3", "output": "5"}
    fields = {"prompt": "{instruction}\n\n{input}", "completion": "output",
              "system": "{instruction} exactly."}
    assert to_messages(alpaca, fields, "r") == _msgs(
        ("system", "Add exactly."), ("user", "Add\n\n2 and 3"), ("assistant", "5"))
    nested = {"chat": {"turns": row["messages"]}}
    assert to_messages(nested, {"messages": "chat.turns"}, "r") == row["messages"]


@pytest.mark.parametrize("messages, match", [
    (_msgs(("user", "hi")), "f: line 4: no assistant turn"),
    (_msgs(("user", "hi"), ("bot", "x")), "f: line 4: message 1 has unknown role 'bot'"),
    (_msgs(("user", "a"), ("user", "b"), ("assistant", "c")),
     "f: line 4: message 1 is 'user' where 'assistant' was due"),
    (_msgs(("assistant", "a"), ("user", "b")), "message 0 is 'assistant' where 'user'"),
    ([{"role": "user"}], "message 0 must be an object with text fields role and content"),
])
def test_bad_conversations_name_the_row(messages, match):
    with pytest.raises(DataError, match=match):
        to_messages({"messages": messages}, {}, "f: line 4")


def test_a_missing_field_names_it_and_the_fix():
    with pytest.raises(DataError, match="r: no field 'question'.*fields.NAME"):
        to_messages({"q": "x", "output": "y"}, {"prompt": "question", "completion": "output"}, "r")


def test_jsonl_and_parquet_rows_name_their_lines(tmp_path):
    good = {"messages": _msgs(("user", "a"), ("assistant", "b"))}
    (tmp_path / "d.jsonl").write_text(json.dumps(good) + "\n\n" + "{oops\n")
    rows = read_rows(str(tmp_path / "d.jsonl"))
    assert next(rows) == (f"{tmp_path / 'd.jsonl'}: line 1", good)
    with pytest.raises(DataError, match="d.jsonl: line 3 is not JSON"):
        next(rows)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([good, good]), tmp_path / "p.parquet")
    got = list(read_rows(str(tmp_path / "p.parquet")))
    assert [w for w, _ in got] == [f"{tmp_path / 'p.parquet'}: row {i}" for i in (0, 1)]
    assert got[1][1] == good
    with pytest.raises(DataError, match="no such file"):
        list(read_rows(str(tmp_path / "missing.jsonl")))


def test_a_saved_hugging_face_dataset_is_read_row_by_row(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    got = [to_messages(row, {}, where) for where, row in read_rows(str(tmp_path / "saved"))]
    assert [m[1]["content"] for m in got] == ["a0", "a1", "a2"]

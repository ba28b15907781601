"""Task files: JSONL, JSON arrays, parquet and Hub-cache files read alike; dotted field paths;
every bad input names the task, the file and the example."""

from __future__ import annotations

import json

import pytest

from kiln.components.errors import DataError
from kiln.components.tasks import task_files
from tests.checkpointing.huggingface.test_hub import offline_cache  # noqa: F401 - the Hub cache fixture
from tests.components.tasks import samples
from tests.components.tokenizers.test_hf_tokenizer import fill_cache


def test_jsonl_json_and_parquet_give_the_same_rows(tmp_path):
    data = samples.rows(5)
    a, _ = task_files.read_rows(str(samples.write_jsonl(tmp_path / "a.jsonl", data)), "t")
    (tmp_path / "b.json").write_text(json.dumps(data))
    b, _ = task_files.read_rows(str(tmp_path / "b.json"), "t")
    c, _ = task_files.read_rows(str(samples.write_parquet(tmp_path / "c.parquet", data)), "t")
    assert a == b == c == data


def test_dotted_paths_and_list_items():
    row = {"choices": {"text": ["x", "y"], "label": ["A", "B"]}, "n": 3}
    assert task_files.value(row, "choices.text", "w") == ["x", "y"]
    assert task_files.value(row, "choices.label.1", "w") == "B"
    assert task_files.text(row, "n", "w") == "3"
    with pytest.raises(DataError, match=r"w: no field 'choices.txt' \(at 'txt'; there: "
                                        r"\['label', 'text'\]\)"):
        task_files.value(row, "choices.txt", "w")
    with pytest.raises(DataError, match="must be text"):
        task_files.text(row, "choices", "w")


@pytest.mark.parametrize("content, message", [
    (None, "task 'mc': file .* not found"),
    ('{"a": 1}\nnot json\n', r"line 2 \(example 1\) is not JSON"),
    ("", "holds no examples"),
    ("[1, 2]", r"example 0 \(the file's 1st\) is not an object"),
])
def test_bad_files_name_the_task_file_and_example(tmp_path, content, message):
    path = tmp_path / "x.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=message):
        task_files.read_rows(str(path), "mc")


def test_a_relative_path_names_the_working_folder_and_a_folder_is_named_as_one(tmp_path,
                                                                              monkeypatch):
    """sft_debug.toml's task path is relative to the repository: run from elsewhere, the
    message said only "file train_configs/tasks/arith_chat.jsonl not found"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"task 'mc': file tasks/x.jsonl not found \(in the "
                                        rf"working folder, {tmp_path}\)"):
        task_files.read_rows("tasks/x.jsonl", "mc")
    (tmp_path / "tasks").mkdir()
    with pytest.raises(DataError, match=r"task 'mc': tasks is a folder: name one file of it"):
        task_files.read_rows("tasks", "mc")


@pytest.mark.parametrize("name", ["x.jsonl", "x.json"])
def test_a_file_not_in_utf8_is_one_error_naming_the_file_and_line(tmp_path, name):
    path = tmp_path / name
    path.write_bytes('{"context": "a"}\n{"context": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match=rf"task 'mc': .*{name}: not UTF-8 text: byte 0xe9 at "
                                        r"line 2; save the file as UTF-8"):
        task_files.read_rows(str(path), "mc")


def test_unknown_suffix_and_no_path(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"unknown file type \.csv; give \.jsonl, \.json"):
        task_files.read_rows(str(tmp_path / "x.csv"), "t")
    with pytest.raises(DataError, match="task 't': no path"):
        task_files.read_rows("", "t")
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="not a readable parquet file"):
        task_files.read_rows(str(tmp_path / "bad.parquet"), "t")


def test_hub_dataset_file_from_the_offline_cache(tmp_path, offline_cache):  # noqa: F811
    src = tmp_path / "src" / "ARC-Easy"
    samples.write_parquet(src / "test-00000-of-00001.parquet", samples.rows(3))
    fill_cache(offline_cache, "allenai/ai2_arc", tmp_path / "src", kind="datasets")
    rows, label = task_files.read_rows(
        "hf://datasets/allenai/ai2_arc/ARC-Easy/test-00000-of-00001.parquet", "arc")
    assert rows == samples.rows(3) and label.startswith("hf://datasets/allenai/ai2_arc/")
    with pytest.raises(DataError, match="not in the Hugging Face cache"):
        task_files.read_rows("hf://datasets/allenai/ai2_arc/ARC-Easy/nope.parquet", "arc")
    with pytest.raises(DataError, match="write hf://datasets/owner/name"):
        task_files.read_rows("hf://datasets/allenai/ai2_arc", "arc")


def test_an_example_is_named_by_its_index_and_its_place_in_the_file():
    from kiln.components.tasks.task_files import example

    assert [example(i).split("'s ")[1] for i in (0, 1, 2, 3, 10, 11, 12, 20, 21, 100, 110)] == [
        "1st)", "2nd)", "3rd)", "4th)", "11th)", "12th)", "13th)", "21st)", "22nd)", "101st)",
        "111th)"]
    assert example(5) == "example 5 (the file's 6th)"

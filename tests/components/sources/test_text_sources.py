"""Reading real corpora: JSONL (plain, gz, zst), parquet, saved HF datasets, folders and globs,
Hub datasets through a pre-filled offline cache; resuming mid-file; bad input errors."""

from __future__ import annotations

import json

import pytest

from kiln.components.errors import DataError
from kiln.components.sources.hub_datasets import select
from kiln.components.sources.text_sources import ReadStats, expand_inputs, read_documents
from tests.components.data.corpora import (
    DOCS,
    write_jsonl,
    write_parquet,
    write_saved_dataset,
)
from tests.components.tokenizers.test_hf_tokenizer import fill_cache


def texts(inputs, **kw):
    out = []
    for src in expand_inputs([str(i) for i in inputs], **{k: v for k, v in kw.items()
                                                          if k in ("split", "config")}):
        out += [t for _, _, t in read_documents(src, **{k: v for k, v in kw.items()
                                                        if k not in ("split", "config")})]
    return out


@pytest.mark.parametrize("compress", ["", "gz", "zst"])
def test_jsonl_plain_and_compressed(tmp_path, compress):
    path = write_jsonl(tmp_path / f"c.jsonl{'.' + compress if compress else ''}",
                       compress=compress)
    assert texts([path]) == DOCS


def test_parquet_and_saved_datasets(tmp_path):
    assert texts([write_parquet(tmp_path / "p.parquet")]) == DOCS
    assert texts([write_saved_dataset(tmp_path / "saved")]) == DOCS
    both = write_saved_dataset(tmp_path / "dict", with_test=True)
    assert texts([both], split="test") == ["held out"] * 3
    with pytest.raises(DataError, match="without split 'dev'; its splits: train, test"):
        expand_inputs([str(both)], split="dev")


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "p.parquet", "saved"])
def test_resume_from_a_position_gives_the_rest(tmp_path, name):
    if name == "p.parquet":
        path = write_parquet(tmp_path / name)
    elif name == "saved":
        path = write_saved_dataset(tmp_path / name)
    else:
        path = write_jsonl(tmp_path / name, compress="gz" if name.endswith("gz") else "")
    (src,) = expand_inputs([str(path)])
    full = list(read_documents(src))
    index, offset, _ = full[24]
    rest = [t for _, _, t in read_documents(src, start=index, offset=offset)]
    assert rest == DOCS[25:]


def test_folders_globs_and_stdlib(tmp_path):
    write_jsonl(tmp_path / "d" / "b.jsonl", DOCS[:3])
    (tmp_path / "d" / "a.txt").write_text("a text file")
    (tmp_path / "d" / "skip.md").write_text("not read")
    write_parquet(tmp_path / "d" / "sub" / "c.parquet", DOCS[3:5])
    assert texts([tmp_path / "d"]) == ["a text file", *DOCS[:5]]
    assert texts([tmp_path / "d" / "**" / "*.parquet"]) == DOCS[3:5]
    files = expand_inputs(["stdlib", str(tmp_path / "d" / "a.txt"), str(tmp_path / "d")])
    assert files[0].name.endswith(".py") and len({f.name for f in files}) == len(files)


def test_bad_rows_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: no 'text' field \(found: body\)"):
        texts([bad])
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(DataError, match="bad.jsonl:2: not a JSON object"):
        texts([bad])
    bad.write_text('{"text": 5}\n')
    with pytest.raises(DataError, match="must be a string"):
        texts([bad])
    with pytest.raises(DataError, match=r"no column 'body' \(columns: id, text\)"):
        texts([write_parquet(tmp_path / "p.parquet")], text_field="body")


def test_invalid_utf8_is_counted_and_skipped_or_fails(tmp_path):
    path = tmp_path / "u.jsonl"
    path.write_bytes(b'{"text": "good"}\n{"text": "bad \xff"}\n{"text": "also good"}\n')
    stats = ReadStats()
    (src,) = expand_inputs([str(path)])
    assert [t for _, _, t in read_documents(src, stats=stats)] == ["good", "also good"]
    assert stats.invalid_utf8 == 1 and stats.where == [f"{path}:2"]
    with pytest.raises(DataError, match=r"u.jsonl:2: invalid UTF-8"):
        list(read_documents(src, on_invalid_utf8="fail"))
    (tmp_path / "b.txt").write_bytes(b"\xff\xfe")
    assert texts([tmp_path / "b.txt"]) == []


def test_empty_and_missing_inputs(tmp_path):
    (tmp_path / "e.txt").write_text("")
    stats = ReadStats()
    (src,) = expand_inputs([str(tmp_path / "e.txt")])
    assert list(read_documents(src, stats=stats)) == [] and stats.empty == 1
    with pytest.raises(DataError, match="no such file or folder"):
        expand_inputs([str(tmp_path / "missing")])
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported file type"):
        expand_inputs([str(tmp_path / "x.csv")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt, .jsonl"):
        expand_inputs([str(tmp_path / "empty")])
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(DataError, match="broken.jsonl.gz: not a readable jsonl.gz file"):
        texts([tmp_path / "broken.jsonl.gz"])


def test_split_selection_follows_hub_file_names():
    paths = ["README.md", "data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
             "data/test-00000-of-00001.parquet", "en/validation/0.jsonl", "fr/train/0.jsonl"]
    assert select(paths, "train", "") == ["data/train-00000-of-00002.parquet",
                                          "data/train-00001-of-00002.parquet", "fr/train/0.jsonl"]
    assert select(paths, "validation", "en") == ["en/validation/0.jsonl"]
    assert select(["a.parquet", "b.jsonl"], "train", "") == ["a.parquet", "b.jsonl"]
    assert select(["a.parquet"], "test", "") == []


def test_hub_dataset_through_the_offline_cache(tmp_path, offline_cache):
    repo = tmp_path / "repo"
    write_parquet(repo / "data" / "train-00000-of-00002.parquet", DOCS[:30])
    write_parquet(repo / "data" / "train-00001-of-00002.parquet", DOCS[30:])
    write_jsonl(repo / "data" / "test-00000-of-00001.jsonl", DOCS[:2])
    fill_cache(offline_cache, "me/corpus", repo, kind="datasets")
    assert texts(["hf://datasets/me/corpus"]) == DOCS
    assert texts(["hf://datasets/me/corpus"], split="test") == DOCS[:2]
    files = expand_inputs(["hf://datasets/me/corpus"])
    assert files[0].name.startswith("hf://datasets/me/corpus@" + "a" * 40 + "/data/train-")
    with pytest.raises(DataError, match="not in the local Hub cache and HF_HUB_OFFLINE"):
        expand_inputs(["hf://datasets/me/absent"])
    with pytest.raises(DataError, match="no data files for split 'dev'"):
        expand_inputs(["hf://datasets/me/corpus"], split="dev")

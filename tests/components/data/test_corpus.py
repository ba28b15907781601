from __future__ import annotations

import json

import pytest

from kiln.components.data.corpus import folder_corpus, open_corpus, stdlib_corpus
from kiln.components.errors import DataError


def test_folder_reads_txt_and_jsonl_in_sorted_order(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.jsonl").write_text(
        json.dumps({"text": "first"}) + "\n\n" + json.dumps({"text": "also first", "id": 3}) + "\n"
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "ignored.md").write_text("not read")
    docs = list(folder_corpus(tmp_path, max_bytes=1000).documents())
    assert docs == ["first", "also first", "second", "third"]


def test_max_bytes_keeps_whole_documents(tmp_path):
    for name, n in [("a", 10), ("b", 50), ("c", 10)]:
        (tmp_path / f"{name}.txt").write_text("x" * n)
    docs = list(folder_corpus(tmp_path, max_bytes=25).documents())
    assert [len(d) for d in docs] == [10, 10]  # b does not fit and is skipped, not cut


def test_description_changes_with_content(tmp_path):
    (tmp_path / "a.txt").write_text("one")
    before = folder_corpus(tmp_path, 100).description
    (tmp_path / "a.txt").write_text("one more")
    assert folder_corpus(tmp_path, 100).description != before


def test_description_changes_with_a_same_size_edit(tmp_path):
    """The cache key hashed path and size: a same-size edit reused the stale entry."""
    import os

    path = tmp_path / "a.txt"
    path.write_text("one")
    before = folder_corpus(tmp_path, 100).description
    path.write_text("two")
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # (coarse clocks)
    assert folder_corpus(tmp_path, 100).description != before


@pytest.mark.parametrize("line", ["not json", json.dumps({"body": "x"}), json.dumps({"text": 3})])
def test_bad_jsonl_line_is_a_data_error(tmp_path, line):
    (tmp_path / "a.jsonl").write_text(line + "\n")
    with pytest.raises(DataError, match="a.jsonl:1"):
        list(folder_corpus(tmp_path, 100).documents())


def test_missing_or_empty_folder(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        folder_corpus(tmp_path / "nope", 100)
    with pytest.raises(DataError, match="holds no .txt"):
        folder_corpus(tmp_path, 100)
    with pytest.raises(DataError, match="needs source_path"):
        open_corpus("folder", "", 100, False)


def test_stdlib_corpus_small_cap():
    corpus = stdlib_corpus(max_bytes=100_000)
    names = [f.relative_to(corpus.root).as_posix() for f in corpus.files]
    assert names == sorted(names) and all(n.endswith(".py") for n in names)
    assert not any("site-packages" in n or n.startswith("test/") for n in names)
    docs = list(corpus.documents())
    assert docs and sum(len(d.encode()) for d in docs) <= 100_000
    assert corpus.description.startswith("stdlib:")
    assert any(n.startswith("test/") for n in
               (f.relative_to(corpus.root).as_posix() for f in stdlib_corpus(1, True).files))

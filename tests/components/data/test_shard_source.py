"""The shard sources of balanced_shards on their own: opening shards, reading rows, listing a
folder (sorted, new shards picked up) and the Hub source's path handling (offline, no network)."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.components.data.shard_source import FolderSource, HubSource, Shard
from kiln.components.errors import DataError

L = 4


def test_two_d_shard_rows_are_cut_and_read_in_any_order(tmp_path):
    arr = np.arange(5 * 7, dtype=np.uint16).reshape(5, 7)
    np.save(tmp_path / "a.npy", arr)
    shard = Shard(tmp_path / "a.npy", L, "a")
    assert shard.rows == 5
    got = shard.read(np.array([3, 0, 3]))
    assert got.dtype == np.int64 and got.shape == (3, L + 1)
    assert np.array_equal(got, arr[[3, 0, 3], :L + 1])


def test_one_d_shard_is_read_as_overlapping_windows(tmp_path):
    stream = np.arange(14, dtype=np.int32)
    np.save(tmp_path / "s.npy", stream)
    shard = Shard(tmp_path / "s.npy", L, "s")
    assert shard.rows == (14 - 1) // L == 3
    got = shard.read(np.array([2, 0]))
    assert np.array_equal(got, [stream[8:13], stream[0:5]])


@pytest.mark.parametrize(("array", "match"), [
    (np.zeros((2, L), np.int32), "rows of 4 tokens"),
    (np.zeros((2, 2, 8), np.int32), "3-D"),
    (np.zeros(20, np.float32), "float32"),
])
def test_bad_shards_are_data_errors(tmp_path, array, match):
    np.save(tmp_path / "bad.npy", array)
    with pytest.raises(DataError, match=match):
        Shard(tmp_path / "bad.npy", L, "bad")


def test_unreadable_file_is_a_data_error(tmp_path):
    (tmp_path / "x.npy").write_bytes(b"not numpy")
    with pytest.raises(DataError, match="not a readable"):
        Shard(tmp_path / "x.npy", L, "x")


def test_folder_listing_is_sorted_and_sees_new_shards(tmp_path):
    src = FolderSource(str(tmp_path))
    assert src.list("code") == []  # a missing domain folder lists nothing
    (tmp_path / "code").mkdir()
    for name in ("shard_2.npy", "shard_0.npy", "notes.txt"):
        (tmp_path / "code" / name).write_bytes(b"")
    assert src.list("code") == ["code/shard_0.npy", "code/shard_2.npy"]
    (tmp_path / "code" / "shard_1.npy").write_bytes(b"")  # uploaded while training
    assert src.list("code") == ["code/shard_0.npy", "code/shard_1.npy", "code/shard_2.npy"]
    assert src.fetch("code/shard_1.npy") == tmp_path / "code" / "shard_1.npy"


def test_hub_source_paths_and_offline_without_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    src = HubSource("me/data", "/data/", "", str(tmp_path), local_files_only=True)
    assert src.offline and src.revision is None and src.where == "hf://datasets/me/data/data"
    assert src._path("code") == "data/code" and src._strip("data/code/a.npy") == "code/a.npy"
    bare = HubSource("me/data", "", "main", "", local_files_only=False)
    assert bare._path("code") == "code" and bare._strip("code/a.npy") == "code/a.npy"
    with pytest.raises(DataError, match="offline and no cached snapshot"):
        src.list("code")


def test_a_hub_that_cannot_be_reached_is_one_error_naming_the_repository(tmp_path,
                                                                        monkeypatch):
    """data.repo_id on a machine without network: the HTTP client's ConnectError came out of
    the first step as a traceback."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    src = HubSource("me/data", "data", "", str(tmp_path), local_files_only=False)

    class ConnectError(Exception):
        pass

    def unreachable(*args, **kwargs):
        raise ConnectError("[Errno -2] Name or service not known")

    class Api:
        def list_repo_tree(self, *args, **kwargs):
            yield from ()  # lazy, as the Hub's is: the error comes with the first entry
            unreachable()

    monkeypatch.setattr(src.hub, "HfApi", Api)
    monkeypatch.setattr(src.hub, "hf_hub_download", unreachable)
    with pytest.raises(DataError, match=r"hf://datasets/me/data/data: cannot list data/code/ "
                                        r"\(ConnectError: \[Errno -2\] Name or service not "
                                        r"known\); check data.repo_id"):
        src.list("code")
    with pytest.raises(DataError, match=r"cannot fetch data/code/a.npy \(ConnectError"):
        src.fetch("code/a.npy")

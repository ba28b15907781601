"""Checkpoint folders: manifests catch truncation and tampering; rotation keeps `final`."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from kiln.checkpointing import layout
from kiln.components.errors import CheckpointError


def make(root, step, files=None):
    folder = root / layout.step_name(step)
    folder.mkdir(parents=True)
    for name, data in (files or {"a.bin": b"x" * 100, "sub/b.json": b"{}"}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    layout.write_manifest(folder, step, {"tokens": step * 10})
    return folder


def test_names():
    assert layout.step_name(1000) == "step_0001000"
    assert layout.step_of("step_0001000") == 1000
    assert layout.step_of("step_12") is None and layout.step_of(".tmp-step_0000001") is None


def test_a_sealed_folder_verifies(tmp_path):
    folder = make(tmp_path, 3)
    manifest = layout.verify(folder)
    assert manifest["step"] == 3 and set(manifest["files"]) == {"a.bin", "sub/b.json"}


@pytest.mark.parametrize("damage, message", [
    (lambda f: (f / "a.bin").write_bytes(b"x" * 50), "truncated"),
    (lambda f: (f / "a.bin").write_bytes(b"y" * 100), r"checksum \(xxh3_128\)"),
    (lambda f: (f / "sub/b.json").unlink(), "missing"),
    (lambda f: (f / "c.bin").write_bytes(b"z"), "not in the manifest"),
    (lambda f: (f / layout.MANIFEST).unlink(), "renamed into place only once"),
    (lambda f: (f / layout.MANIFEST).write_text("{not json"), "unreadable manifest"),
    (lambda f: (f / layout.MANIFEST).write_text(json.dumps({"format": "other"})), "not a kiln"),
])
def test_damaged_folders_give_a_clear_error(tmp_path, damage, message):
    folder = make(tmp_path, 3)
    damage(folder)
    with pytest.raises(CheckpointError, match=message):
        layout.verify(folder)


def test_a_version_1_manifest_is_still_verified_with_its_sha256(tmp_path):
    folder = make(tmp_path, 3)
    m = json.loads((folder / layout.MANIFEST).read_text())
    files = {rel: {"size": info["size"], "sha256": layout.sha256(folder / rel)}
             for rel, info in m["files"].items()}
    (folder / layout.MANIFEST).write_text(json.dumps({**m, "version": 1, "files": files}))
    assert layout.verify(folder)["version"] == 1
    (folder / "a.bin").write_bytes(b"y" * 100)
    with pytest.raises(CheckpointError, match=r"checksum \(sha256\)"):
        layout.verify(folder)


def test_the_checksum_is_xxh3_128_of_the_bytes(tmp_path):
    import xxhash

    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "data").write_bytes(bytes(range(256)) * 1000)
    assert layout.checksum(tmp_path / "empty") == xxhash.xxh3_128(b"").hexdigest()
    assert layout.checksum(tmp_path / "data") == \
        xxhash.xxh3_128(bytes(range(256)) * 1000).hexdigest()


def test_future_format_version_is_refused(tmp_path):
    folder = make(tmp_path, 3)
    m = json.loads((folder / layout.MANIFEST).read_text())
    (folder / layout.MANIFEST).write_text(json.dumps({**m, "version": 99}))
    with pytest.raises(CheckpointError, match="format version 99"):
        layout.verify(folder)


def test_newest_complete_skips_incomplete_with_a_warning(tmp_path):
    make(tmp_path, 1)
    make(tmp_path, 2)
    broken = make(tmp_path, 3)
    (broken / "a.bin").write_bytes(b"")
    (tmp_path / ".tmp-step_0000004").mkdir()  # a save in progress: not a checkpoint
    with pytest.warns(UserWarning, match="ignoring incomplete checkpoint"):
        assert layout.newest_complete(tmp_path).name == "step_0000002"


def test_rotation_keeps_the_newest_and_final(tmp_path):
    for s in (1, 2, 3, 4, 5):
        make(tmp_path, s)
    layout.set_link(tmp_path, "final", "step_0000002")
    removed = layout.rotate(tmp_path, keep_last=2)
    assert removed == ["step_0000001", "step_0000003"]
    kept = ["final", "step_0000002", "step_0000004", "step_0000005"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [  # set aside, not yet deleted
        ".tmp-purge-step_0000001", ".tmp-purge-step_0000003", *kept]
    assert [s for s, _ in layout.list_checkpoints(tmp_path)] == [2, 4, 5]
    layout.purge(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == kept
    assert (tmp_path / "final" / "a.bin").is_file()
    assert layout.rotate(tmp_path, keep_last=0) == []


def test_publish_replaces_an_existing_folder_and_links_are_atomic(tmp_path):
    make(tmp_path, 1)
    tmp = tmp_path / ".tmp-new"
    tmp.mkdir()
    (tmp / "x").write_text("new")
    layout.publish(tmp, tmp_path / "step_0000001")
    assert (tmp_path / "step_0000001" / "x").read_text() == "new" and not tmp.exists()
    layout.set_link(tmp_path, "final", "step_0000001")
    layout.set_link(tmp_path, "final", "step_0000001")
    assert os.readlink(tmp_path / "final") == "step_0000001"


def test_a_final_folder_from_a_copy_that_followed_links_is_moved_aside(tmp_path):
    """shutil.copytree (or cp -L) of a run turns the final link into a folder; the rename over
    it raised IsADirectoryError after the resumed run's last step. Now it is kept aside."""
    make(tmp_path, 1)
    make(tmp_path, 2)
    shutil.copytree(tmp_path / "step_0000001", tmp_path / "final")
    with pytest.warns(UserWarning, match="final was a folder, not a link"):
        layout.set_link(tmp_path, "final", "step_0000002")
    assert os.readlink(tmp_path / "final") == "step_0000002"
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("final.copied-")]
    assert len(aside) == 1 and (aside[0] / "a.bin").is_file()
    assert [s for s, _ in layout.list_checkpoints(tmp_path)] == [1, 2]


def test_index_lists_complete_checkpoints(tmp_path):
    make(tmp_path, 1)
    make(tmp_path, 2)
    layout.write_atomic(tmp_path / "latest", "step_0000002\n")
    layout.set_link(tmp_path, "final", "step_0000002")
    layout.write_index(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["latest"] == "step_0000002" and index["final"] == "step_0000002"
    assert [e["step"] for e in index["checkpoints"]] == [1, 2]
    assert index["checkpoints"][0]["tokens"] == 10

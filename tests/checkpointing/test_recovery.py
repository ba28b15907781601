"""Unattended recovery: the newest of three snapshots is corrupt (one byte), rerunning moves it to
checkpoints/corrupt/, says so loudly (console, metrics, RECOVERED.json), resumes from the
second and ends with the uninterrupted run's losses; strict_resume refuses; with no valid
snapshot left the error lists what was tried and the command exits 2."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln.recipes.cli import main
from tests.checkpointing.elastic import COMMON, RECIPES, losses, train
from tests.conftest import CONFIGS

EVERY_STEP = ["--checkpoint.interval=1", "--checkpoint.keep_last=3"]


def _flip_byte(folder) -> None:
    path = max((p for p in folder.iterdir() if p.suffix == ".distcp"),
               key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _cli(folder, *extra) -> int:
    name, tiny = RECIPES["dense"]
    return main(["train", str(CONFIGS / name), *COMMON, *tiny, *EVERY_STEP,
                 f"--run.folder={folder}", *extra])


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    """An uninterrupted run, and the same run stopped after step 5 (snapshots 3, 4, 5)."""
    tmp = tmp_path_factory.mktemp("recovery")
    train("dense", tmp / "full", *EVERY_STEP)
    train("dense", tmp / "cut", *EVERY_STEP, stop_after=5)
    ck = tmp / "cut" / "checkpoints"
    assert sorted(p.name for p in ck.glob("step_*")) == [f"step_000000{i}" for i in (3, 4, 5)]
    _flip_byte(ck / "step_0000005")
    return tmp


def test_recovers_from_the_newest_valid_snapshot_and_ends_like_the_full_run(cut, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(cut / "cut", run)
    out = train("dense", run, *EVERY_STEP)
    assert "WARNING: checkpoint step_0000005 is corrupt" in out and "sha256" in out
    assert "RECOVERED from 1 corrupt snapshot(s): resuming from step_0000004" in out
    assert "resumed from" in out and "step_0000004 at step 4" in out
    ck = run / "checkpoints"
    assert (ck / "corrupt" / "step_0000005").is_dir()  # kept for inspection
    record = json.loads((run / "RECOVERED.json").read_text())["events"]
    assert record[0]["resumed_from"] == "step_0000004" and record[0]["step"] == 4
    assert record[0]["corrupt"][0]["checkpoint"] == "step_0000005"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("checkpoint/recovered") == 1.0 and r["step"] == 4 for r in rows)
    assert losses(run) == losses(cut / "full")  # steps 5 and 6 retrained: bit-identical
    assert (ck / "latest").read_text().strip() == "step_0000006"


def test_strict_resume_refuses(cut, tmp_path, capsys):
    run = tmp_path / "strict"
    shutil.copytree(cut / "cut", run)
    assert _cli(run, "--checkpoint.strict_resume=true") == 2
    err = capsys.readouterr().err
    assert "sha256" in err and "strict_resume = true" in err
    assert (run / "checkpoints" / "step_0000005").is_dir()  # nothing moved
    assert not (run / "RECOVERED.json").exists()


def test_no_valid_snapshot_left_lists_what_was_tried_and_exits_2(cut, tmp_path, capsys):
    run = tmp_path / "none"
    shutil.copytree(cut / "cut", run)
    for step in (3, 4):
        _flip_byte(run / "checkpoints" / f"step_000000{step}")
    assert _cli(run) == 2
    err = capsys.readouterr().err
    assert "no valid checkpoint left" in err
    for step in (5, 4, 3):
        assert f"step_000000{step}: " in err
    assert sorted(p.name for p in (run / "checkpoints" / "corrupt").iterdir()) == [
        "step_0000003", "step_0000004", "step_0000005"]

"""Unattended recovery: the newest of three snapshots is damaged (one flipped byte, a truncated
or deleted file, no manifest, a truncated state.json: all alike), rerunning moves it to
checkpoints/corrupt/, says so loudly (console, metrics, RECOVERED.json), resumes from the
second and ends with the uninterrupted run's losses; strict_resume refuses; with no valid
snapshot left the error lists what was found and the flags that start over, the command exits 2
(and again on the next start), and the run is never trained again from step 1 by itself."""

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


def _truncate(path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "flipped byte": _flip_byte,
    "truncated tensor file": lambda f: _truncate(max(f.glob("*.distcp"),
                                                    key=lambda p: p.stat().st_size)),
    "deleted rank file": lambda f: (f / "rank_00000.safetensors").unlink(),
    "no manifest": lambda f: (f / "manifest.json").unlink(),
    "truncated state.json": lambda f: _truncate(f / "state.json"),
}


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    """An uninterrupted run, and the same run stopped after step 5 (snapshots 3, 4, 5)."""
    tmp = tmp_path_factory.mktemp("recovery")
    train("dense", tmp / "full", *EVERY_STEP)
    train("dense", tmp / "cut", *EVERY_STEP, stop_after=5)
    ck = tmp / "cut" / "checkpoints"
    assert sorted(p.name for p in ck.glob("step_*")) == [f"step_000000{i}" for i in (3, 4, 5)]
    return tmp


def _copy(cut, run, damage="flipped byte", steps=(5,)):
    shutil.copytree(cut / "cut", run)
    for step in steps:
        DAMAGE[damage](run / "checkpoints" / f"step_000000{step}")
    return run


@pytest.mark.parametrize("damage, says", [
    ("flipped byte", "checksum"), ("truncated tensor file", "truncated"),
    ("deleted rank file", "missing files"), ("no manifest", "no manifest.json"),
    ("truncated state.json", "truncated")])
def test_recovers_from_the_newest_valid_snapshot_and_ends_like_the_full_run(cut, tmp_path,
                                                                           damage, says):
    run = _copy(cut, tmp_path / "run", damage)
    out = train("dense", run, *EVERY_STEP)
    assert "WARNING: checkpoint step_0000005 is corrupt" in out and says in out
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
    run = _copy(cut, tmp_path / "strict")
    assert _cli(run, "--checkpoint.strict_resume=true") == 2
    err = capsys.readouterr().err
    assert "checksum" in err and "strict_resume = true" in err
    assert (run / "checkpoints" / "step_0000005").is_dir()  # nothing moved
    assert not (run / "RECOVERED.json").exists()


def test_no_valid_snapshot_left_lists_what_was_tried_and_exits_2(cut, tmp_path, capsys):
    run = _copy(cut, tmp_path / "none", steps=(5, 4, 3))
    assert _cli(run) == 2
    err = capsys.readouterr().err
    assert "none is usable" in err
    for step in (5, 4, 3):
        assert f"step_000000{step}: " in err
    assert sorted(p.name for p in (run / "checkpoints" / "corrupt").iterdir()) == [
        "step_0000003", "step_0000004", "step_0000005"]


def test_a_run_whose_snapshots_all_lack_their_manifest_is_not_started_over(cut, tmp_path,
                                                                           capsys):
    """The issue's repro: every manifest removed. Before: a silent restart from step 1 (exit 0)
    that overwrote the snapshots."""
    run = _copy(cut, tmp_path / "nomanifest", "no manifest", steps=(5, 4, 3))
    metrics = (run / "metrics.jsonl").read_text()
    assert _cli(run) == 2
    err = capsys.readouterr().err
    assert "none is usable, so kiln does not start it over" in err
    assert "--checkpoint.resume=off" in err and "--run.folder=NEW_FOLDER" in err
    for step in (5, 4, 3):
        assert f"step_000000{step}: " in err and "no manifest.json" in err
    corrupt = run / "checkpoints" / "corrupt"
    assert sorted(p.name for p in corrupt.iterdir()) == [f"step_000000{i}" for i in (3, 4, 5)]
    event = json.loads((run / "RECOVERED.json").read_text())["events"][-1]
    assert event["resumed_from"] is None and len(event["corrupt"]) == 3
    assert (run / "metrics.jsonl").read_text() == metrics  # nothing trained, nothing logged
    # The next start finds only the set-aside snapshots: it stops again.
    assert _cli(run) == 2
    assert "set aside by an earlier start" in capsys.readouterr().err
    # Starting over on purpose: the flag the message names.
    assert _cli(run, "--checkpoint.resume=off") == 0
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_0000006"
    assert sorted(p.name for p in corrupt.iterdir()) == [f"step_000000{i}" for i in (3, 4, 5)]


def test_starting_over_on_purpose_keeps_the_earlier_snapshots_aside(cut, tmp_path):
    """resume = "off" in a folder with valid snapshots: they move to checkpoints/previous/1
    (untouched, said in one line), the new run saves, rotates and later resumes among its own
    snapshots only (before: its step 3 was rotated out at once by the old run's newer 4 and 5,
    which it then overwrote one by one, so a crash in between resumed the old run), and it
    trains as a fresh run does."""
    run = shutil.copytree(cut / "cut", tmp_path / "again")
    ck = run / "checkpoints"
    before = {i: (ck / f"step_000000{i}" / "manifest.json").read_bytes() for i in (3, 4, 5)}
    out = train("dense", run, *EVERY_STEP, "--checkpoint.resume=off")
    assert ('checkpoint.resume = "off": this run folder\'s snapshots step_0000003, '
            "step_0000004, step_0000005 moved to") in out
    previous = ck / "previous" / "1"
    assert {i: (previous / f"step_000000{i}" / "manifest.json").read_bytes()
            for i in (3, 4, 5)} == before
    assert sorted(p.name for p in ck.glob("step_*")) == [f"step_000000{i}" for i in (4, 5, 6)]
    assert (ck / "latest").read_text().strip() == "step_0000006"
    fresh = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    started = max(i for i, r in enumerate(fresh) if "session" in r)
    assert {r["step"]: r["loss"] for r in fresh[started:] if "loss" in r} == losses(cut / "full")
    assert "already finished" in train("dense", run, *EVERY_STEP)  # auto: its own step 6

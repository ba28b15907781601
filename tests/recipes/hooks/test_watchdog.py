"""The hang watchdog: a step far slower than usual makes every rank dump its stacks to RUN/hang/
and the run exit 3 naming the slowest rank. The decisions in-process (with the exit faked);
a stalled step in a real run alone, and on one of 2 gloo ranks under the launcher (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from kiln.recipes.hooks.watchdog import Watchdog, WatchdogConfig, slowest
from tests import forked
from tests.conftest import REPO

WORKER = REPO / "tests" / "recipes" / "hooks" / "hang_worker.py"


def header(done: int, in_collective: bool, where: str = "train.py:1 step") -> dict:
    return {"done": done, "in_collective": in_collective, "where": where, "host": "h",
            "device": "cpu"}


# ------------------------------------------------------------------------------- decisions
def test_the_rank_behind_is_the_slowest():
    ranks, why = slowest({0: header(5, True), 1: header(4, False), 2: header(5, True)})
    assert ranks == [1] and "4 steps done" in why


def test_among_equals_the_rank_outside_a_collective_is_the_slowest():
    ranks, why = slowest({0: header(3, True), 1: header(3, False, "data.py:9 read")})
    assert ranks == [1] and "not in a collective" in why and "rank 1: data.py:9 read" in why


def test_among_equals_the_rank_that_issued_fewer_collectives_is_the_slowest():
    """On CUDA every rank may block outside torch.distributed (collectives are asynchronous);
    the flight recorder's sequence numbers still show who is behind."""
    heads = {0: header(3, False), 1: header(3, False), 2: header(3, False)}
    for r, seq in ((0, 40), (1, 38), (2, 40)):
        heads[r]["collectives"] = {"0/default_pg": seq, f"{r}/only_mine": 99}
    ranks, why = slowest(heads)
    assert ranks == [1] and "issued 38 collectives where the others issued up to 40" in why


def test_collectives_issued_reads_the_flight_recorder():
    from kiln.recipes.hooks.watchdog import collectives_issued

    trace = json.dumps({"entries": [
        {"collective_seq_id": 3, "process_group": ["0", "default_pg"]},
        {"collective_seq_id": 5, "process_group": ["0", "default_pg"]},
        {"collective_seq_id": 1, "process_group": ["1", "tp"]}]})
    assert collectives_issued(trace) == {"0/default_pg": 5, "1/tp": 1}
    assert collectives_issued(None) == {} == collectives_issued("not json")


def test_a_rank_without_a_dump_is_named_first():
    assert slowest({0: header(3, True), 1: None})[0] == [1]


def test_everyone_in_a_collective_points_at_the_flight_recorder():
    ranks, why = slowest({0: header(3, True), 1: header(3, True)})
    assert ranks == [0, 1] and "flight recorder" in why


def test_threshold_arms_after_the_first_step_from_the_median():
    dog = Watchdog(WatchdogConfig(factor=10, min_s=1))
    assert dog.threshold() is None
    dog.durations.extend([0.2, 0.3, 5.0])  # one slow step does not move the median much
    dog.first = False
    assert dog.threshold() == pytest.approx(3.0)
    dog.durations.clear()
    dog.durations.extend([0.01])
    assert dog.threshold() == 1.0  # at least min_s
    assert Watchdog(WatchdogConfig(timeout_s=7)).threshold() is None  # still the first step
    fixed = Watchdog(WatchdogConfig(timeout_s=7))
    fixed.step_begins()
    fixed.step_ends(1)
    assert fixed.threshold() == 7 and not fixed.durations  # the first step is no sample


# ------------------------------------------------------------- the thread, in this process
def _trainer(folder, rank: int = 0, world_size: int = 1):
    return SimpleNamespace(run_dir=folder, progress=SimpleNamespace(step=0),
                           world=SimpleNamespace(rank=rank, world_size=world_size,
                                                 is_main=rank == 0),
                           device=torch.device("cpu"))


def _start(tmp_path, cfg: WatchdogConfig, **kw):
    exits = []
    done = threading.Event()
    dog = Watchdog(cfg, exit=lambda code: (exits.append(code), done.set()))
    dog.on_train_start(_trainer(tmp_path, **kw))
    return dog, exits, done


def test_a_stalled_step_dumps_the_stacks_and_exits_3(tmp_path, capsys):
    (tmp_path / "hang").mkdir()  # an earlier hang's folder is kept aside
    (tmp_path / "hang" / "trigger.json").write_text('{"reason": "old"}')
    dog, exits, done = _start(tmp_path, WatchdogConfig(timeout_s=0.3, poll_s=0.05, grace_s=1))
    try:
        assert [p.name for p in tmp_path.glob("hang_*")] and not (tmp_path / "hang").exists()
        dog.step_begins()
        dog.step_ends(1)  # armed
        dog.step_begins()
        assert done.wait(30), "the watchdog did not fire"
    finally:
        dog.close(None)
    assert exits == [3]
    dump = (tmp_path / "hang" / "rank_0.txt").read_text()
    head = json.loads(dump.splitlines()[0])
    assert head["done"] == 1 and head["in_collective"] is False
    assert "test_a_stalled_step_dumps_the_stacks_and_exits_3" in dump  # the main thread's stack
    err = capsys.readouterr().err
    assert "kiln train: error: hang: step 2 made no progress" in err
    assert "run.watchdog.timeout_s = 0.3 s" in err and "slowest: rank 0 (" in err


def test_another_ranks_trigger_makes_this_rank_dump_too(tmp_path, capsys):
    """Rank 1 is between steps (no window open) when rank 0 fires: it dumps all the same."""
    dog, exits, done = _start(tmp_path, WatchdogConfig(poll_s=0.05, grace_s=0.5), rank=1,
                              world_size=2)
    try:
        (tmp_path / "hang").mkdir()
        (tmp_path / "hang" / "trigger.json").write_text(json.dumps(
            {"rank": 0, "reason": "step 9 made no progress for 400 s"}))
        assert done.wait(30), "the watchdog did not follow the trigger"
    finally:
        dog.close(None)
    assert exits == [3] and (tmp_path / "hang" / "rank_1.txt").is_file()
    err = capsys.readouterr().err
    assert "step 9 made no progress for 400 s (seen by another rank)" in err
    assert "slowest: rank 0: wrote no dump" in err  # rank 0 never wrote one here


def test_an_unwritable_run_folder_still_ends_the_hang(tmp_path, capsys):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    dog, exits, done = _start(blocked, WatchdogConfig(timeout_s=0.2, poll_s=0.05))
    try:
        dog.step_begins()
        dog.step_ends(1)
        dog.step_begins()
        assert done.wait(30), "the watchdog did not fire"
    finally:
        dog.close(None)
    err = capsys.readouterr().err
    assert exits == [3] and "the dumps could not be written" in err
    assert "Thread MainThread" in err and "test_an_unwritable_run_folder" in err  # the stacks


def test_a_quiet_run_never_fires(tmp_path):
    dog, exits, _ = _start(tmp_path, WatchdogConfig(timeout_s=5, poll_s=0.02))
    for step in range(5):
        dog.step_begins()
        dog.step_ends(step + 1)
    time.sleep(0.2)
    dog.close(None)
    assert exits == [] and not (tmp_path / "hang").exists()


# --------------------------------------------------------------------------- real runs
@pytest.mark.slow
def test_a_stalled_run_exits_3_with_its_stacks(tmp_path):
    out = forked.run([sys.executable, str(WORKER), str(tmp_path / "run"), "0", "4"], REPO,
                     timeout=600)
    assert out.returncode == 3, out.stdout[-2000:] + out.stderr[-2000:]
    assert "not reached" not in out.stdout
    assert "kiln train: error: hang: step 4 made no progress" in out.stderr
    dump = (tmp_path / "run" / "hang" / "rank_0.txt").read_text()
    assert "hang_worker.py" in dump and " in step" in dump  # where the main thread stalled
    assert (tmp_path / "run" / "checkpoints" / "step_0000002").is_dir()  # resumable


@pytest.mark.slow
def test_the_slow_rank_of_two_is_named_and_every_rank_dumps(tmp_path):
    from tests.parallelisms.tiny import free_port

    cmd = [sys.executable, "-m", "kiln.recipes.runs.launch", "--standalone", "--nproc-per-node=2",
           f"--master-port={free_port()}", str(WORKER), str(tmp_path / "run"), "1", "4"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]
    assert "kiln train: error: hang:" in out.stderr, out.stderr[-3000:]
    # rank 0 issued step 4's first all-gather (FSDP2), rank 1 stalled before it
    assert "slowest: rank 1 (" in out.stderr and "collectives where the others issued" \
        in out.stderr, out.stderr[-3000:]
    hang = tmp_path / "run" / "hang"
    heads = {r: json.loads((hang / f"rank_{r}.txt").read_text().splitlines()[0])
             for r in range(2)}
    assert heads[0]["in_collective"] and not heads[1]["in_collective"]
    assert heads[0]["done"] == heads[1]["done"] == 3
    assert heads[0]["collectives"]["0/default_pg"] > heads[1]["collectives"]["0/default_pg"]
    assert "hang_worker.py" in (hang / "rank_1.txt").read_text()
    trace = json.loads((hang / "rank_0.flight_recorder.json").read_text())
    assert trace["entries"], "the flight recorder kept no collective"

"""Errors under torchrun: one kiln message and kiln's exit status, whichever rank failed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.recipes.runs.launch import ERROR_DIR, read_reports, summarize
from tests import forked
from tests.conftest import REPO

KILN = {"kind": "kiln", "prefix": "kiln train", "exit_code": 2, "message": "bad recipe"}
CRASH = {"kind": "exception", "traceback": "Traceback (most recent call last):\nRuntimeError: x"}


def _write(folder, rank, report) -> None:
    (folder / f"rank_{rank:05d}.json").write_text(json.dumps(report))


def test_a_kiln_error_on_any_rank_wins_over_its_consequences(tmp_path):
    _write(tmp_path, 0, CRASH)  # e.g. "connection closed by peer" after rank 1 left
    _write(tmp_path, 1, KILN)
    message, status = summarize(read_reports(tmp_path), {0: (1, "exited")})
    assert (message, status) == ("kiln train: error: bad recipe", 2)


def test_without_a_kiln_error_the_first_traceback_is_shown(tmp_path):
    _write(tmp_path, 1, CRASH)
    message, status = summarize(read_reports(tmp_path), {1: (1, "exited")})
    assert message.startswith("rank 1 failed:\nTraceback") and status == 1


def test_a_worker_killed_without_a_report_is_named(tmp_path):
    message, status = summarize([], {1: (-15, "was killed by SIGTERM")})
    assert (message, status) == ("kiln: rank 1 was killed by SIGTERM (exit code -15)", 1)
    message, status = summarize([], {1: (3, "exited")})
    assert message == "kiln: rank 1 exited (exit code 3) without an error report"


def test_a_killed_rank_is_named_not_the_survivors_traceback(tmp_path):
    # Rank 1 was killed; rank 0 then failed in a collective ("Connection reset by peer").
    _write(tmp_path, 0, {**CRASH, "traceback": "Traceback ...\nRuntimeError: [gloo] Connection "
                                                "reset by peer\n"})
    message, status = summarize(read_reports(tmp_path), {0: (1, "exited"),
                                                          1: (-9, "was killed by SIGKILL")})
    assert status == 1 and "Traceback" not in message
    assert message.splitlines() == [
        "kiln: rank 1 was killed by SIGKILL (exit code -9); the kernel's out-of-memory killer "
        "sends SIGKILL too: see `dmesg`",
        "kiln: rank 0 failed after it: RuntimeError: [gloo] Connection reset by peer"]


def test_a_worker_dies_with_its_launcher(tmp_path):
    # A stand-in launcher starts a worker the way torchrun does (its own session, the
    # launcher's PID in the environment); the worker binds, starts a child, reports both.
    worker = ("import os, subprocess, sys, time; from kiln.recipes.runs.launch import "
              "bind_to_launcher; bind_to_launcher(); child = subprocess.Popen([sys.executable, "
              "'-c', 'import os, time; print(os.environ.get(\"KILN_LAUNCHER_PID\"), flush=True);"
              " time.sleep(600)'], stdout=sys.stdout); print(os.getpid(), child.pid, flush=True);"
              " time.sleep(600)")
    launcher = ("import os, subprocess, sys, time; os.environ['KILN_LAUNCHER_PID'] = "
                "str(os.getpid()); subprocess.Popen([sys.executable, '-c', sys.argv[1]], "
                "start_new_session=True, stdout=sys.stdout); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", launcher, worker], cwd=REPO, text=True,
                            stdout=subprocess.PIPE)
    lines = sorted([proc.stdout.readline().split(), proc.stdout.readline().split()], key=len)
    assert lines[0] == ["None"]  # the worker's own child is not bound to the launcher
    worker_pid, child_pid = map(int, lines[1])
    try:
        proc.send_signal(signal.SIGKILL)  # kill -9 of the launcher alone
        proc.wait()
        assert gone_within([worker_pid], 30)
    finally:
        for pid in (worker_pid, child_pid):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()


def gone_within(pids: list[int], seconds: float) -> bool:
    """Whether every process of ``pids`` ends within ``seconds``."""
    deadline = time.monotonic() + seconds
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for its reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_reports_instead_of_printing(tmp_path):
    env = {**os.environ, ERROR_DIR: str(tmp_path), "RANK": "1", "WORLD_SIZE": "2"}
    out = subprocess.run([sys.executable, "-m", "kiln.recipes.cli", "show", "missing.toml"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and out.stderr == ""
    (report,) = read_reports(tmp_path)
    assert report["rank"] == 1 and report["exit_code"] == 2
    assert "missing.toml: recipe file not found" in report["message"]


def _run_train(tmp_path, ngpu: int, *extra: str, launch: bool = True
               ) -> subprocess.CompletedProcess:
    """``NGPU=ngpu ./run_train.sh`` on a tiny model; ``launch=False`` forks it instead (a run the
    test only needs the checkpoint of)."""
    cmd = ["./run_train.sh", "train_configs/debug.toml", "--training.steps=1",
           "--model.dim=32", "--model.n_layers=1", "--model.attention.n_heads=2",
           "--model.ffn.hidden_dim=64", "--training.seq_len=32", "--data.max_bytes=300000",
           "--data.eval_fraction=0.2", "--eval.tokens=256", f"--run.folder={tmp_path / 'run'}",
           *extra]
    env = {**os.environ, "NGPU": str(ngpu)}
    if not launch:
        return forked.run(cmd, REPO, env, timeout=600)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_two_processes_fail_with_one_message_and_kiln_status(tmp_path):
    # Rank 0 fails alone (rank 1 waits for it to build the data): kiln's message, status 1.
    missing = _run_train(tmp_path, 2, f"--data.path={tmp_path / 'nowhere'}")
    text = missing.stdout + missing.stderr
    assert missing.returncode == 1, text
    assert "Traceback" not in text and text.count("error:") == 1
    assert "kiln train: error: data.path = " in missing.stderr  # no dataset folder there
    # Resuming with a changed model shape: every rank refuses, status 2 (a checkpoint error).
    assert _run_train(tmp_path, 1, launch=False).returncode == 0
    two = _run_train(tmp_path, 2, "--training.steps=2", "--model.dim=48")
    text = two.stdout + two.stderr
    assert two.returncode == 2, text
    assert "Traceback" not in text and text.count("error:") == 1
    assert "kiln train: error:" in two.stderr and "model.dim: 32 -> 48" in two.stderr


def _training(tmp_path, *extra: str,
              until: str = "metrics.jsonl") -> tuple[subprocess.Popen, dict[int, int]]:
    """`NGPU=2 ./run_train.sh` (its own process group) once RUN/``until`` exists: (launcher,
    rank -> pid)."""
    cmd = ["./run_train.sh", "train_configs/debug.toml", "--training.steps=100000",
           "--model.dim=32", "--model.n_layers=1", "--model.attention.n_heads=2",
           "--model.ffn.hidden_dim=64", "--training.seq_len=32", "--data.max_bytes=300000",
           "--data.eval_fraction=0.2", "--eval.interval=0", "--checkpoint.enable=false",
           "--run.log_interval=1", "--run.progress_bar=false", f"--run.folder={tmp_path / 'r'}",
           *extra]
    env = {k: v for k, v in os.environ.items()  # the recipe's flight recorder, not a leftover
           if k not in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")}
    proc = subprocess.Popen(cmd, cwd=REPO, env={**env, "NGPU": "2"}, text=True,
                            start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not (tmp_path / "r" / until).exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    ranks = {}
    for pid in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split():
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        ranks.update({int(e[5:]): int(pid) for e in env if e.startswith(b"RANK=")})
    assert sorted(ranks) == [0, 1]
    return proc, ranks


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_named(tmp_path):
    proc, ranks = _training(tmp_path)
    os.kill(ranks[1], signal.SIGKILL)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    assert "Traceback" not in out + err
    assert err.startswith("kiln: rank 1 was killed by SIGKILL (exit code -9)"), err
    assert not any(_alive(pid) for pid in ranks.values())


@pytest.mark.slow
def test_the_workers_die_with_their_launcher(tmp_path):
    proc, ranks = _training(tmp_path)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # kill -9 -PGID of `NGPU=2 ./run_train.sh`
        proc.wait()
        assert gone_within(list(ranks.values()), 30)
    finally:
        for pid in ranks.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()
        proc.stderr.close()


@pytest.mark.slow
def test_a_rank_stopped_in_a_checkpoint_save_ends_the_run_at_the_collective_timeout(tmp_path):
    proc, ranks = _training(tmp_path, "--checkpoint.enable=true", "--checkpoint.interval=20",
                            "--parallelism.collective_timeout_s=5",
                            "--parallelism.flight_recorder=50",
                            until="checkpoints/step_0000020")
    root = tmp_path / "r" / "checkpoints"
    try:
        while not any(p.name.startswith(".tmp-") for p in root.iterdir()):  # the next save
            assert proc.poll() is None
            time.sleep(0.002)
        os.kill(ranks[1], signal.SIGSTOP)
        started = time.monotonic()
        assert gone_within([ranks[0]], 60)  # the waiting rank fails at the collective timeout
        took = time.monotonic() - started
        # torchrun SIGKILLs the stopped rank after its 30 s grace (a stopped process takes no
        # SIGTERM); the same kill here, without waiting it out
        os.kill(ranks[1], signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        for pid in ranks.values():
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 1 and took < 20, (took, err)  # the 5 s collective timeout
    # gloo words its 5 s timeout two ways: a recv that waited ("Timed out waiting 5000ms"), or
    # a send to the stopped rank whose socket timed out ("Application timeout caused pair
    # closure"); which one rank 0 meets depends on where in the save rank 1 was stopped
    assert "Timed out waiting 5000ms" in err or "Application timeout caused pair closure" in err
    trace = json.loads((tmp_path / "r" / "hang" / "rank_0.flight_recorder.json").read_text())
    assert 0 < len(trace["entries"]) <= 50
    from kiln.checkpointing import layout

    assert [p.name for _, p in layout.list_checkpoints(root)] == ["step_0000020"]
    assert layout.is_complete(root / "step_0000020")

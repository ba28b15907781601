"""One run per run folder: a second `kiln train` on a folder in use exits 2 naming the holder; a
killed holder leaves no stale lock; a folder made only for the lock does not outlive the run."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from kiln.components.errors import RunFolderInUse
from kiln.recipes.cli import main
from kiln.recipes.runs import lock as run_lock
from kiln.recipes.runs.lock import LOCK_FILE, RunLock
from tests import forked
from tests.conftest import CONFIGS, REPO

TINY = ["--model.dim=32", "--model.n_layers=1", "--model.attention.n_heads=2",
        "--model.ffn.hidden_dim=64", "--training.seq_len=32", "--training.global_batch=4",
        "--training.micro_batch=2", "--data.max_bytes=300000", "--data.eval_fraction=0.2",
        "--eval.interval=0", "--eval.tokens=256", "--run.progress_bar=false",
        "--run.log_interval=1", "--checkpoint.enable=false"]


def _holder(folder) -> subprocess.Popen:
    """Another process holding the run folder's lock (as a live `kiln train` does)."""
    code = ("import sys, time; from kiln.recipes.runs.lock import RunLock; "
            "RunLock.take(sys.argv[1]); print('held', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def _kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


def test_kiln_train_on_a_held_folder_exits_2_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        status = main(["train", str(CONFIGS / "debug.toml"), *TINY, "--training.steps=1",
                       f"--run.folder={run}"])
        err = capsys.readouterr().err
        assert status == 2, err
        assert f"kiln train, PID {holder.pid} on host {socket.gethostname()}" in err
        assert err.startswith(f"kiln train: error: run folder {run} is in use by another run")
        assert "--run.folder" in err and not (run / "recipe.toml").exists()
        with pytest.raises(RunFolderInUse, match=f"PID {holder.pid} "):
            RunLock.take(run)
    finally:
        _kill(holder)
    # kill -9 leaves its kiln.lock (naming a dead process) but no lock: the next run takes it
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == holder.pid
    lock = RunLock.take(run)
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    assert run.is_dir() and not (run / LOCK_FILE).exists()  # the folder was not made by us


def test_a_run_that_fails_before_step_1_leaves_no_folder(tmp_path, capsys):
    run = tmp_path / "runs" / "fresh"
    status = main(["train", str(CONFIGS / "debug.toml"), *TINY, f"--run.folder={run}",
                   f"--data.path={tmp_path / 'missing'}"])
    assert status == 1 and "dataset folder" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_folders_made_for_the_lock_go_only_when_nothing_was_written(tmp_path):
    lock = RunLock.take(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b" / LOCK_FILE).is_file()
    lock.release()
    assert list(tmp_path.iterdir()) == []
    lock = RunLock.take(tmp_path / "a" / "b")
    (tmp_path / "a" / "b" / "recipe.toml").write_text("")
    lock.release()
    assert [p.name for p in (tmp_path / "a" / "b").iterdir()] == ["recipe.toml"]


def test_a_lock_file_removed_as_it_is_opened_is_not_the_one_taken(tmp_path, monkeypatch):
    # The holder's release unlinks kiln.lock between our open and our lockf: a lock on that
    # unlinked file would exclude nobody, so take() opens the new file instead.
    real_open, calls = os.open, []

    def open_then_lose_it(path, *args):
        fd = real_open(path, *args)
        calls.append(path)
        if len(calls) == 1:
            os.unlink(path)
        return fd

    monkeypatch.setattr(run_lock.os, "open", open_then_lose_it)
    lock = RunLock.take(tmp_path)
    assert len(calls) == 2 and run_lock._same_file(lock.fd, tmp_path / LOCK_FILE)
    lock.release()


def test_a_filesystem_without_locks_warns_and_runs(tmp_path, monkeypatch, capsys):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(run_lock.fcntl, "lockf", no_locks)
    lock = RunLock.take(tmp_path / "run")
    assert lock.fd is None and "a second run on this folder would not be stopped" in \
        capsys.readouterr().err
    lock.release()


def _command(folder, *extra: str) -> list[str]:
    return ["./run_train.sh", "train_configs/debug.toml", *TINY, f"--run.folder={folder}", *extra]


@pytest.mark.slow
def test_a_second_kiln_train_exits_2_and_a_killed_one_leaves_the_folder_free(tmp_path):
    run = tmp_path / "run"
    first = forked.start(_command(run, "--training.steps=100000"), REPO)  # processes of their
    try:  # own, forked (tests/forked.py); torchrun's ranks are the next test's
        while first.poll() is None and not (run / "recipe.toml").exists():  # step 1 done
            time.sleep(0.1)
        second = forked.run(_command(run, "--training.steps=2", "--optimizer.lr=1e-3"), REPO)
        assert second.returncode == 2, second.stdout + second.stderr
        assert f"is in use by another run (kiln train, PID {first.pids[0]} on host " \
            in second.stderr
        assert "Traceback" not in second.stderr and second.stdout == ""
    finally:
        os.kill(first.pids[0], signal.SIGKILL)
        assert first.wait(timeout=60).returncode == -9
    losses = _losses(run)
    third = forked.run(_command(run, "--training.steps=2"), REPO)
    assert third.returncode == 0, third.stdout + third.stderr
    assert not (run / LOCK_FILE).exists()
    # the third run appended its own two steps: nothing of the refused second run is there
    assert [step for step, _ in _losses(run)] == [step for step, _ in losses] + [1, 2]


def _losses(run) -> list[tuple[int, float]]:
    lines = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return [(d["step"], d["loss"]) for d in lines if "loss" in d]


@pytest.mark.slow
def test_under_torchrun_every_rank_stops_with_one_message(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        out = subprocess.run(_command(tmp_path / "run", "--training.steps=1"), cwd=REPO,
                             env={**os.environ, "NGPU": "2"}, capture_output=True, text=True,
                             timeout=600)
    finally:
        _kill(holder)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert "Traceback" not in text and text.count("error:") == 1
    assert f"is in use by another run (kiln train, PID {holder.pid} on host" in out.stderr

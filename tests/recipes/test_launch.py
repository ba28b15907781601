"""Errors under torchrun: one kiln message and kiln's exit status, whichever rank failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kiln.recipes.launch import ERROR_DIR, read_reports, summarize
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
    message, status = summarize([], {1: (-9, "was killed by SIGKILL")})
    assert message == "kiln: rank 1 was killed by SIGKILL (exit code -9) without an error report"
    assert status == 1


def test_a_worker_reports_instead_of_printing(tmp_path):
    env = {**os.environ, ERROR_DIR: str(tmp_path), "RANK": "1", "WORLD_SIZE": "2"}
    out = subprocess.run([sys.executable, "-m", "kiln.recipes.cli", "show", "missing.toml"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 2 and out.stderr == ""
    (report,) = read_reports(tmp_path)
    assert report["rank"] == 1 and report["exit_code"] == 2
    assert "missing.toml: recipe file not found" in report["message"]


def _run_train(tmp_path, ngpu: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = ["./run_train.sh", "train_configs/debug.toml", "--training.steps=1",
           "--model.dim=32", "--model.n_layers=1", "--model.attention.n_heads=2",
           "--model.ffn.hidden_dim=64", "--training.seq_len=32", "--data.max_bytes=300000",
           "--data.eval_fraction=0.2", "--eval.tokens=256", f"--run.folder={tmp_path / 'run'}",
           *extra]
    env = {**os.environ, "NGPU": str(ngpu)}
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_two_processes_fail_with_one_message_and_kiln_status(tmp_path):
    # Rank 0 fails alone (rank 1 waits for it to build the data): kiln's message, status 1.
    missing = _run_train(tmp_path, 2, f"--data.path={tmp_path / 'nowhere'}")
    text = missing.stdout + missing.stderr
    assert missing.returncode == 1, text
    assert "Traceback" not in text and text.count("error:") == 1
    assert "kiln train: error: dataset folder" in missing.stderr
    # Resuming with a changed model shape: every rank refuses, status 2 (a checkpoint error).
    assert _run_train(tmp_path, 1).returncode == 0
    two = _run_train(tmp_path, 2, "--training.steps=2", "--model.dim=48")
    text = two.stdout + two.stderr
    assert two.returncode == 2, text
    assert "Traceback" not in text and text.count("error:") == 1
    assert "kiln train: error:" in two.stderr and "model.dim: 32 -> 48" in two.stderr

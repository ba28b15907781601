"""tests/forked.py: a forked kiln command answers as its own process would, and spawned workers
get the test's environment and working folder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import forked
from tests.conftest import REPO


def test_which_command_lines_are_forked():
    assert forked.is_forkable(["kiln", "show", "x.toml"])
    assert forked.is_forkable(["./run_train.sh", "r.toml"])
    assert forked.processes(["./run_train.sh", "r.toml"], {"NGPU": "2"}) == 2
    assert not forked.is_forkable(["./run_train.sh", "r.toml"], {"NGPU": "2", "NNODES": "2"})
    assert not forked.is_forkable(["kiln", "train", "r.toml"], {"NGPU": "2"})
    assert not forked.is_forkable(["kiln", "train", "r.toml"], {"OMP_NUM_THREADS": "1"})
    assert forked.is_forkable([sys.executable, "scripts/tiny_hf_model.py"])
    assert forked.is_forkable([sys.executable, "-m", "kiln.recipes.cli", "show", "x.toml"])
    assert forked.is_forkable([sys.executable, "-c", "print(1)"])
    # a forked command's own subprocess.run forks scripts and modules, never -c code (which
    # tests use to check what a fresh interpreter imports)
    assert forked.python_target([sys.executable, "-c", "print(1)"]) is None
    assert not forked.is_forkable(["/usr/bin/env", "python3", "x.py"])


@pytest.mark.slow
def test_a_forked_command_gives_the_exit_status_and_output_of_a_process(tmp_path):
    argv = ["kiln", "show", "missing.toml"]
    real = subprocess.run([sys.executable, "-m", "kiln.recipes.cli", *argv[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    got = forked.run(argv, tmp_path)
    assert (got.returncode, got.stdout, got.stderr) == (real.returncode, real.stdout, real.stderr)
    assert got.returncode == 2 and "missing.toml" in got.stderr
    shown = forked.run(["kiln", "show", str(REPO / "train_configs" / "debug.toml")], tmp_path,
                        env={**os.environ, "KILN_TEST_MARK": "1"})
    assert shown.returncode == 0 and "[model]" in shown.stdout, shown.stderr


class _Exited:
    """A child as ``forked._wait`` sees it, already ended with ``exitcode``."""

    def __init__(self, exitcode):
        self.exitcode = exitcode

    def kill(self):
        self.exitcode = -9 if self.exitcode is None else self.exitcode

    def join(self):
        pass


def test_ranks_that_failed_together_answer_with_the_shown_rank_and_a_lone_failure_with_its_own():
    # both ranks stopped on the same bad recipe before the wait looked: the shown rank's
    # message and status, once (the race that showed the message twice)
    assert forked._wait([_Exited(2), _Exited(2)], timeout=5) == 0
    assert forked._wait([_Exited(2), _Exited(2)], timeout=5, shown=1) == 1
    # one rank failed while the shown one still ran: the failure counts, the runner is stopped
    running = _Exited(None)
    assert forked._wait([running, _Exited(3)], timeout=5) == 1 and running.exitcode == -9
    assert forked._wait([_Exited(0), _Exited(0)], timeout=5) == 0


def test_the_failed_ranks_message_is_added_once_and_only_when_the_shown_rank_lacks_it():
    # rank 1 stopped on the bad recipe while rank 0, having printed the same message, still ran
    # (the race that showed the message twice in CI); a message of its own is still added
    for rank0, rank1, want in (("bad recipe\n", "bad recipe\n", "bad recipe\n"),
                               ("", "bad recipe\n", "[rank 1]\nbad recipe\n")):
        started = forked.Started(["kiln"], shown=0)
        for rank, text in enumerate((rank0, rank1)):
            started.files(rank)[1].write_text(text)
        started.children = [_Exited(None), _Exited(2)]
        done = started.wait(timeout=5)
        assert (done.returncode, done.stderr) == (2, want)


@pytest.mark.slow
def test_a_forked_two_rank_launch_answers_with_the_shown_ranks_output_and_status(tmp_path):
    two = forked.run(["./run_train.sh", "missing.toml"], tmp_path, env={**os.environ, "NGPU": "2"})
    assert two.returncode == 2 and two.stderr.count("missing.toml: recipe file not found") == 1


@pytest.mark.slow
def test_a_started_command_runs_until_waited_for_and_a_signal_ends_it_as_a_process(tmp_path):
    code = "import sys, time; print('up', sys.argv[1:], flush=True); time.sleep(600)"
    started = forked.start([sys.executable, "-c", code, "x"], tmp_path)
    deadline = time.monotonic() + 120
    while not started.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.output() == "up ['x']\n" and len(started.pids) == 1
    os.kill(started.pids[0], signal.SIGKILL)
    done = started.wait(timeout=60)
    assert done.returncode == -9 and done.stdout == "up ['x']\n"


CHILD = """import os, sys
print("child", sys.argv[1:], os.getcwd(), os.environ["KILN_TEST_MARK"])
print("to stderr", file=sys.stderr)
sys.exit(3)
"""
PARENT = """import subprocess, sys
out = subprocess.run([sys.executable, "child.py", "a b"], capture_output=True, text=True,
                     env={"KILN_TEST_MARK": "inner"})
print(out.returncode, repr(out.stdout), repr(out.stderr))
print(subprocess.call([sys.executable, "-m", "child", "c"], cwd="sub"))
"""


@pytest.mark.slow
def test_a_forked_script_and_the_python_commands_it_starts_answer_as_processes(tmp_path):
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "child.py").write_text(CHILD)
    (tmp_path / "parent.py").write_text(PARENT)
    env = {**os.environ, "KILN_TEST_MARK": "outer"}
    got = forked.run([sys.executable, "parent.py"], tmp_path, env=env)
    real = subprocess.run([sys.executable, "parent.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert (got.returncode, got.stdout, got.stderr) == (real.returncode, real.stdout, real.stderr)
    assert got.stdout == (f"3 \"child ['a b'] {tmp_path} inner\\n\" 'to stderr\\n'\n"
                          f"child ['c'] {tmp_path / 'sub'} outer\n3\n")
    assert got.stderr == "to stderr\n"


def _write_env(index: int, folder: str) -> None:
    Path(folder, f"{index}.txt").write_text(f"{os.environ.get('KILN_TEST_MARK')} {os.getcwd()}")


@pytest.mark.slow
def test_spawned_workers_see_this_processs_environment_and_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_TEST_MARK", "set-by-the-test")
    monkeypatch.chdir(tmp_path)
    forked.spawn(_write_env, args=(str(tmp_path),), nprocs=2)
    for index in (0, 1):
        assert (tmp_path / f"{index}.txt").read_text() == f"set-by-the-test {tmp_path}"


@pytest.mark.slow
def test_the_preloaded_modules_read_no_hub_or_cache_setting_at_import():
    """The server imports them once, with the environment of its start; a module that reads
    HF_HOME, HF_HUB_OFFLINE or KILN_CACHE at import would keep that value in every child."""
    code = ("import sys; import " + ", ".join(forked.PRELOAD) + "; print(' '.join(sorted("
            "m for m in ('huggingface_hub', 'transformers', 'datasets', 'lm_eval', 'peft') "
            "if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == ""

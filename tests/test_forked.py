"""tests/forked.py: a forked kiln command answers as its own process would, and spawned workers
get the test's environment and working folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import forked
from tests.conftest import REPO


def test_which_command_lines_are_forked():
    assert forked.is_forkable(["kiln", "show", "x.toml"])
    assert forked.is_forkable(["./run_train.sh", "r.toml"])
    assert not forked.is_forkable(["./run_train.sh", "r.toml"], {"NGPU": "2"})
    assert not forked.is_forkable(["kiln", "train", "r.toml"], {"OMP_NUM_THREADS": "1"})
    assert not forked.is_forkable(["python", "scripts/tiny_hf_model.py"])


@pytest.mark.slow
def test_a_forked_command_gives_the_exit_status_and_output_of_a_process(tmp_path):
    argv = ["kiln", "show", "missing.toml"]
    real = subprocess.run([sys.executable, "-m", "kiln.recipes.cli", *argv[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    got = forked.kiln(argv, tmp_path)
    assert (got.returncode, got.stdout, got.stderr) == (real.returncode, real.stdout, real.stderr)
    assert got.returncode == 2 and "missing.toml" in got.stderr
    shown = forked.kiln(["kiln", "show", str(REPO / "train_configs" / "debug.toml")], tmp_path,
                        env={**os.environ, "KILN_TEST_MARK": "1"})
    assert shown.returncode == 0 and "[model]" in shown.stdout, shown.stderr


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

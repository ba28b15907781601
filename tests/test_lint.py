"""The house lint passes: `ruff check .` with the settings in pyproject.toml (line length,
import order, pyflakes). Part of the suite so that CI, which runs the README's test command,
enforces it too (a long line once reached main because only the pre-commit habit checked it)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import REPO


def test_ruff_check_passes():
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is in the dev extra: pip install -e '.[dev]'")
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO,
                         capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr

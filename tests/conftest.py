"""Shared fixtures: recipes written into temp folders, a clean registry per test."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"

torch.set_num_threads(min(2, os.cpu_count() or 1))

# What `pytest --fast` leaves out (docs/contributing.md, "Two tiers"): each runs in the full suite
FULL_ONLY = ("slow", "docs", "matrix")


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the inner-loop tier: leave out tests marked " + ", ".join(FULL_ONLY))


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--fast"):
        return
    keep, left = [], []
    for item in items:
        (left if any(item.get_closest_marker(m) for m in FULL_ONLY) else keep).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = keep


@pytest.fixture
def write(tmp_path):
    """write("name.toml", text) -> path of a dedented TOML file in tmp_path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    return _write


# Everything a test (or a process it starts) might write under the user's home or cache goes
# to the session's temp folder instead: kiln's data cache, Hugging Face, pip and torch caches.
# Set once for the session before any module- or class-scoped fixture runs (pytest runs
# session-scoped autouse fixtures first), so no fixture can prepare data in the real cache.
# tests/test_isolation.py checks it.
ISOLATED = {
    "KILN_CACHE": "kiln-cache",
    "HF_HOME": "hf-home",
    "HF_HUB_CACHE": "hf-home/hub",
    "XDG_CACHE_HOME": "xdg-cache",
    "TORCH_HOME": "torch-home",
}


@pytest.fixture(scope="session", autouse=True)
def _isolated_caches(tmp_path_factory):
    """Point every cache at the session's temp folder (shared by all tests: a dataset is
    prepared once per session)."""
    root = tmp_path_factory.getbasetemp()
    with pytest.MonkeyPatch.context() as mp:
        for var, sub in ISOLATED.items():
            mp.setenv(var, str(root / sub))
        yield root

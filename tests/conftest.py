"""Shared fixtures: recipes written into temp folders, a clean registry per test."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

# One intra-op thread in every test process: pytest-xdist runs a worker per core, and each
# worker's forked kiln commands and gloo ranks would otherwise start a thread per core too.
# Set before torch is imported, so the forkserver and subprocesses inherit it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch.compile's kernels built in the test's own process: a pool of compile workers costs a
# fresh interpreter importing torch (seconds) in every process that compiles.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# What `pytest --fast` leaves out (docs/contributing.md, "Two tiers"): each runs in the full suite
FULL_ONLY = ("slow", "docs", "matrix")


def pytest_addoption(parser):
    parser.addoption("--fast", action="store_true",
                     help="the inner-loop tier: leave out tests marked " + ", ".join(FULL_ONLY))


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core this process may use (xdist counts physical cores), and
    two more: tests wait on their subprocesses, gloo peers, file locks and timeouts, and the
    extra workers run other modules meanwhile (on 2 cores, one more worker took a full run's
    idle time from 86 core-s to 8; a second one took the run from 640-645 s to 527-601 s,
    docs/contributing.md)."""
    if hasattr(os, "sched_getaffinity"):  # Linux: the cores this process is allowed
        cores = len(os.sched_getaffinity(0))
    else:  # macOS, Windows
        cores = os.cpu_count() or 1
    return cores + 2


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, except that each docs page's steps are a unit of their own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class FileOrPage(LoadFileScheduling):
        """A test module's tests go to one worker (its module-scoped fixtures are built once);
        so do a docs page's steps (run in order, in one folder), but each page to any worker."""

        def _split_scope(self, nodeid: str) -> str:
            file, _, test = nodeid.partition("::")
            if file.endswith("test_readme.py") and test.startswith("test_readme_step["):
                return "docs page " + test.removeprefix("test_readme_step[").split(":L")[0]
            return file

    config.option.loadscopereorder = False  # keep the order below, not most tests first
    return FileOrPage(config, log)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--fast"):
        keep, left = [], []
        for item in items:
            (left if any(item.get_closest_marker(m) for m in FULL_ONLY) else keep).append(item)
        if left:
            config.hook.pytest_deselected(items=left)
            items[:] = keep
    # Modules with long tests first, so that no xdist worker is left with one at the end; whole
    # modules move, so a module's tests stay together (its fixtures are set up once).
    long = {i.module.__name__ for i in items if any(i.get_closest_marker(m) for m in FULL_ONLY)}
    items.sort(key=lambda i: i.module.__name__ not in long)


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


def session_root(tmp_path_factory) -> Path:
    """The test session's temp folder: under xdist, the one above every worker's own (the
    cache builds take a lock, so two workers wanting one dataset build it once)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session", autouse=True)
def _isolated_caches(tmp_path_factory):
    """Point every cache at the session's temp folder (shared by all tests: a dataset is
    prepared once per session)."""
    root = session_root(tmp_path_factory)
    with pytest.MonkeyPatch.context() as mp:
        for var, sub in ISOLATED.items():
            mp.setenv(var, str(root / sub))
        yield root

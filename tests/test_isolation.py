"""The test suite never writes into the user's caches or home (tests/conftest.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiln.components.data.packed_documents import cache_root
from tests.conftest import ISOLATED, session_root

HOME_CACHE = Path("~/.cache/kiln").expanduser()


@pytest.fixture(scope="module")
def module_scoped_cache() -> Path:
    """What a module-scoped fixture (such as a prepared dataset) sees: it runs before any
    function-scoped fixture, which is how data once landed in the user's cache."""
    return cache_root()


def test_caches_point_into_the_session_temp_folder(tmp_path_factory, module_scoped_cache):
    base = session_root(tmp_path_factory).resolve()
    for var in ISOLATED:
        assert Path(os.environ[var]).resolve().is_relative_to(base), var
    assert module_scoped_cache.resolve().is_relative_to(base)
    assert not module_scoped_cache.resolve().is_relative_to(HOME_CACHE.resolve())
    assert cache_root().resolve().is_relative_to(base)


def test_subprocesses_inherit_the_isolated_cache():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", "from kiln.components.data.packed_documents import cache_root; "
         "print(cache_root())"], capture_output=True, text=True, check=True, timeout=120)
    assert Path(out.stdout.strip()) == Path(os.environ["KILN_CACHE"])

"""Where kiln keeps what it builds once and reuses (prepared data, trained tokenizers, fetched
task files), and the lock that lets processes build one thing once.

A leaf module: the data, tokenizer and task rooms all use it, so none of them needs another's.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


def cache_root(cache_dir: str = "") -> Path:
    """``cache_dir``, else ``$KILN_CACHE``, else ``~/.cache/kiln``."""
    return Path(cache_dir or os.environ.get("KILN_CACHE") or "~/.cache/kiln").expanduser()


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Serialises builders on one machine; the atomic rename covers the rest."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        try:
            import fcntl
        except ImportError:  # not POSIX: rely on the atomic rename alone
            yield
            return
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

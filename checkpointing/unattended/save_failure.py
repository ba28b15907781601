"""What a failed save says, and what it leaves behind: nothing.

A save can fail anywhere: a full disk makes torch's zip writer stop with ``RuntimeError: [enforce
fail at inline_container.cc:672] unexpected pos ...`` (no errno), an async save wraps its errors
in DCP's ``CheckpointException`` (a ``BaseException``, so ``except Exception`` misses it), a
sealing or renaming step raises ``OSError``. Each becomes one line naming the step and the cause
("no space left on device" when the errno says so or the file system is nearly full), and the
newest snapshot that is still intact; the partial folder is removed.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from kiln.checkpointing import layout
from kiln.components import distributed

# What a save may raise: everything but a process exit or a Ctrl-C (those are not save failures).
SAVE_ERRORS = (Exception, CheckpointException)
_FULL = (errno.ENOSPC, errno.EDQUOT)
NEARLY_FULL = 64 << 20  # bytes: below this a write failure without an errno is taken as "full"


class SaveFailed(Exception):  # noqa: N818 (internal signal between a save's phases)
    """Raised on every rank when any rank's part of a save failed; ``reason`` is the same text
    on every rank."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# How ``describe`` names a full disk; the manager's advice keys on it.
FULL_DISK = "no space left on device"


def together(world, root: Path, part: Callable[[], Any]) -> Any:
    """Run this rank's ``part`` of a save. If it failed on any rank, every rank raises
    SaveFailed with the same reason (the lowest failing rank's): no rank is left waiting in a
    collective for one that gave up. One tiny all-reduce (and a broadcast on failure)."""
    result, reason = None, None
    try:
        result = part()
    except SAVE_ERRORS as exc:
        reason = describe(exc, root)
    if world.distributed:
        ws = world.world_size
        first = torch.tensor([float(world.rank if reason is not None else ws)])
        src = int(distributed.all_reduce_(first, "min").item())
        if src < ws:
            reason = distributed.broadcast_object(reason, src=src)
            reason = reason if src == 0 else f"rank {src}: {reason}"
    if reason is not None:
        raise SaveFailed(reason)
    return result


def describe(exc: BaseException, root: Path) -> str:
    """The cause of a failed save in a few words. Call it before removing the partial save: the
    free space it reports is what the save ran out of."""
    causes = list(_chain(exc))
    full = any(isinstance(e, OSError) and e.errno in _FULL for e in causes)
    mount = _mount_point(root)
    free = _free_bytes(mount)
    if full or (free is not None and free < NEARLY_FULL):
        left = f" has {_size(free)} free" if free is not None else ""
        return f"{FULL_DISK}: the file system at {mount}{left}"
    inner = next((e for e in causes if not isinstance(e, CheckpointException)), exc)
    text = " ".join(f"{type(inner).__name__}: {inner}".split())
    return text if len(text) <= 300 else text[:300] + " ..."


def discard(tmp: Path) -> None:
    """Remove a failed save's temporary folder (rank 0). If that fails too, the next save's
    ``remove_temporaries`` tries again; a resume ignores ``.tmp-*`` folders either way."""
    shutil.rmtree(tmp, ignore_errors=True)


def message(step: int, reason: str, root: Path) -> str:
    previous = [(s, p) for s, p in layout.list_checkpoints(root) if s < step
                and layout.is_complete(p)]
    kept = (f"the previous checkpoint step {previous[-1][0]} is intact ({previous[-1][1]})"
            if previous else "there is no earlier checkpoint")
    return f"checkpoint step {step} FAILED ({reason}); {kept}; the partial save was removed"


def _chain(exc: BaseException):
    """``exc``, what it wraps (DCP's per-rank failures) and its causes, outermost first."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        if isinstance(e, CheckpointException):
            todo += [f for f, _ in e.failures.values()]  # (exception, traceback) per rank
        todo += [e.__cause__, e.__context__]


def _mount_point(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _size(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} bytes"

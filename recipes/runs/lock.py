"""One run per run folder: ``kiln train`` holds ``RUN/kiln.lock`` for the life of the run.

Two runs writing one folder interleave their metrics, log a step twice with two losses and
delete each other's unfinished checkpoint saves. So the run takes an advisory POSIX record lock
(``fcntl.lockf``) on ``kiln.lock`` in the run folder before it builds anything, and a second
run on the folder stops at once (exit 2) naming the holder's host and PID, which the holder
writes into the file. The kernel drops the lock when the holding process ends, however it ends:
a killed run (kill -9, out of memory, a lost node) never leaves a stale lock, only a stale
``kiln.lock`` whose text names a process that no longer holds it; the next run takes it.

- A record lock, not ``flock``: it also works over NFS, and a forked child (a data-loader
  worker) does not inherit it, so it goes when the trainer process goes. Its one pitfall is that
  closing *any* descriptor of the file drops it: nothing in the holder reads the file.
- Under torchrun only global rank 0 takes it (the run folder is written by rank 0; the other
  ranks write only their checkpoint files into it) and tells every rank the outcome, so all of
  them stop with the same message. Several nodes: one lock for the job, on rank 0's node; it
  also stops a second job started on another node if the shared filesystem supports POSIX locks
  (NFSv3 with lockd, NFSv4, Lustre mounted with ``flock``); elsewhere taking it fails with
  ENOLCK or the like and the run goes on with a warning.
- The trainer writes the run folder only when the first step is done, so a run that fails
  while starting leaves no folder. The lock needs the folder earlier: a folder created for the
  lock is removed again when the run ends having written nothing into it.
- ``kiln eval``, ``generate`` and ``export`` read a run's published snapshots without the lock
  (they never change once published; evaluating or exporting a live run is normal), and
  ``export`` writes only its own output folder, new or emptied.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kiln.components.errors import KilnError, RecipeError, RunFolderInUse

if TYPE_CHECKING:  # imported when used: taking the lock needs no torch
    from kiln.components.distributed import World

LOCK_FILE = "kiln.lock"
_BUSY = (errno.EACCES, errno.EAGAIN)  # lockf: another process holds it


class RunLock:
    """The held lock on ``folder``; ``release()`` (or the end of the process) lets it go."""

    def __init__(self, folder: Path, fd: int | None, created: list[Path],
                 name: str = LOCK_FILE) -> None:
        self.folder, self.fd, self.created, self.name = folder, fd, created, name

    @classmethod
    def take(cls, folder: str | Path, command: str = "kiln train", *, name: str = LOCK_FILE,
             wait: bool = False) -> RunLock:
        """Lock ``folder`` (created when missing) or raise ``RunFolderInUse``; ``wait``: until
        the holder lets go instead. ``name``: the lock file (``kiln sweep`` claims a point's
        folder with its own, the run inside it takes ``kiln.lock``)."""
        folder = Path(folder)
        created = [p for p in (folder, *folder.parents) if not p.exists()]  # innermost first
        path = folder / name
        for _ in range(100):  # retried only while another run removes the file or its folder
            try:
                folder.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:
                continue  # a failed run removed the folder it had created: make it again
            except OSError as exc:
                raise RecipeError(f"run.folder = {str(folder)!r}: cannot create {path} "
                                  f"({exc.strerror}); choose another --run.folder") from None
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in _BUSY:
                    raise RunFolderInUse(_busy_message(folder, path)) from None
                print(f"kiln: warning: cannot lock {path} ({exc.strerror}): this filesystem has "
                      "no POSIX locks, so a second run on this folder would not be stopped",
                      file=sys.stderr)
                return cls(folder, None, created, name)
            if not _same_file(fd, path):  # the holder removed this file as we opened it
                os.close(fd)
                continue
            holder = {"host": socket.gethostname(), "pid": os.getpid(), "command": command,
                      "since": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
            return cls(folder, fd, created, name)
        raise RunFolderInUse(f"run folder {folder}: could not take {path}: other processes keep "
                             "removing it; try again")

    def release(self) -> None:
        """Remove the lock file (while still holding it, so no one takes a removed file), let
        go, and remove the folders ``take`` created if the run wrote nothing into them."""
        if self.fd is None:
            return
        try:
            (self.folder / self.name).unlink(missing_ok=True)
            for folder in self.created:
                try:
                    folder.rmdir()
                except OSError:  # not empty: the run wrote into it (or a new run took it)
                    break
        finally:
            os.close(self.fd)
            self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def holder_of(path: Path) -> str:
    """Who holds the lock file ``path``, as its holder wrote it."""
    try:
        who = json.loads(path.read_text(encoding="utf-8"))
        return (f"{who['command']}, PID {who['pid']} on host {who['host']}, since "
                f"{who['since']}")
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its host and PID yet"


def _busy_message(folder: Path, path: Path) -> str:
    return (f"run folder {folder} is in use by another run ({holder_of(path)}; the lock is "
            f"{path}): wait for it to end or stop it, or give another --run.folder")


@contextlib.contextmanager
def hold_run_folder(folder: str | Path, world: World) -> Iterator[None]:
    """Hold the run folder's lock for the block: rank 0 takes it, every rank learns the outcome
    (a refusal raises the same error on every rank)."""
    from kiln.components import distributed

    lock, refusal = None, None
    if world.is_main:
        try:
            lock = RunLock.take(folder)
        except KilnError as exc:
            refusal = exc
    refusal = distributed.broadcast_object(refusal)
    if refusal is not None:
        raise refusal
    try:
        yield
    finally:
        if lock is not None:
            lock.release()

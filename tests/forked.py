"""Processes for tests without paying torch's import in each one.

A fresh Python spends about 5 s importing torch and ``torch._dynamo`` (which
``torch.optim`` and meta-device init import) before a kiln command does any work: most of a
two-step run. The suite starts a few hundred such processes, so here they are forked from
multiprocessing's forkserver, one process per session that has imported torch once (never run
an op, so no OpenMP pool is copied) and forks a child per request. A child is a new process
like any other: its own memory, signals, exit status; only the import work is shared.

- ``spawn(fn, args, nprocs)``: ``torch.multiprocessing.spawn`` for the gloo rank workers.
- ``kiln(argv, cwd, env)``: one kiln command line (``kiln ...`` or ``./run_train.sh ...`` on
  one process), run as ``kiln``'s console script runs it, returned like ``subprocess.run``.
- ``train_ranks(args, nprocs, logs)``: ``kiln train ARGS`` on ``nprocs`` gloo ranks with the
  rank variables torchrun sets, for a reference run that a test compares a real launch with.

What needs a real launch stays on ``subprocess``: torchrun (``NGPU=2``), signals and kill -9,
the installed ``kiln`` script itself, a fresh environment.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch.multiprocessing

# Imported once by the server. Only modules that read no test setting at import: anything
# reading HF_HOME or KILN_CACHE at import (huggingface_hub, transformers) stays out, and each
# child imports it with the test's environment. tests/test_forked.py checks the list.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.utils.tensorboard", "numpy", "pydantic", "tests.forked_preload"]


@functools.cache
def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # before the server starts, on first use
    return ctx


def _in_env(index: int, env: dict[str, str], fn, args: tuple) -> None:
    # The server's environment is the one it started with; a worker gets the test's.
    os.environ.clear()
    os.environ.update(env)
    fn(index, *args)


def spawn(fn, args: tuple = (), nprocs: int = 2) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)``, the workers forked from the server
    (with this process's environment and working folder); a worker's error is raised here."""
    _context()
    torch.multiprocessing.start_processes(_in_env, args=(dict(os.environ), fn, args),
                                          nprocs=nprocs, start_method="forkserver")


def _run_command(argv: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    """In the child: what ``kiln ARGS`` or ``./run_train.sh ARGS`` does, with the exit status a
    process would have (an uncaught exception: its traceback and 1)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    args = argv[1:]
    if Path(argv[0]).name == "run_train.sh":  # one process: `exec python -m kiln.recipes.cli train`
        args = ["train", *args]
    sys.argv = ["kiln", *args]
    try:
        from kiln.recipes.cli import main

        code = main(args)
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what the interpreter does on the way out
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def is_forkable(argv: list[str], env: dict[str, str] | None = None) -> bool:
    """Whether ``kiln`` runs this command line in a forked child: a kiln command, or
    run_train.sh on one process with no launch variables."""
    env = env or {}
    if any(key in env for key in ("NGPU", "NNODES", "OMP_NUM_THREADS")):
        return False
    return argv[0] == "kiln" or Path(argv[0]).name == "run_train.sh"


def kiln(argv: list[str], cwd: Path | str, env: dict[str, str] | None = None,
         timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run a kiln command line (``is_forkable``) in a child forked from the server with the
    environment ``env`` (default: this process's); its output and exit status."""
    assert is_forkable(argv), argv
    with tempfile.TemporaryDirectory(prefix="kiln-forked-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        child = _context().Process(target=_run_command, args=(
            list(argv), str(cwd), dict(os.environ if env is None else env), str(out), str(err)))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(argv, timeout, _text(out), _text(err))
        # Like subprocess: -N when signal N ended the child.
        return subprocess.CompletedProcess(argv, child.exitcode, _text(out), _text(err))


def _train_rank(index: int, nprocs: int, port: int, args: list[str], logs: str) -> None:
    from tests.parallelisms.tiny import rank_env

    rank_env(index, nprocs, port)
    log = Path(logs, f"rank{index}.txt")
    with log.open("w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    from kiln.recipes.cli import main

    code = main(["train", *args])
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        raise RuntimeError(f"rank {index}: kiln train exited {code}:\n{_text(log)[-3000:]}")


def train_ranks(args: list[str], nprocs: int, logs: Path) -> None:
    """``kiln train ARGS`` on ``nprocs`` ranks over gloo, forked (no torchrun launcher, no
    fresh interpreters); each rank's output in ``logs/rank{i}.txt``."""
    from tests.parallelisms.tiny import free_port

    logs.mkdir(parents=True, exist_ok=True)
    spawn(_train_rank, args=(nprocs, free_port(), list(args), str(logs)), nprocs=nprocs)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")

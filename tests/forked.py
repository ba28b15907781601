"""Processes for tests without paying torch's import in each one.

A fresh Python spends about 5 s importing torch and ``torch._dynamo`` (which
``torch.optim`` and meta-device init import) before a kiln command does any work: most of a
two-step run. The suite starts a few hundred such processes, so here they are forked from
multiprocessing's forkserver, one process per session that has imported torch once (never run
an op, so no OpenMP pool is copied) and forks a child per request. A child is a new process
like any other: its own memory, signals, exit status; only the import work is shared.

- ``spawn(fn, args, nprocs)``: ``torch.multiprocessing.spawn`` for the gloo rank workers.
- ``run(argv, cwd, env)``: one command line (``kiln ...``, ``./run_train.sh ...`` with ``NGPU``
  ranks on one node, Python on a script, a ``-m`` module or ``-c`` code), run as its process
  would run it, returned like ``subprocess.run``; ``start`` is the same without waiting, for a
  test that signals or kills the processes while they run.
- ``train_ranks(args, nprocs, logs)``: ``kiln train ARGS`` on ``nprocs`` gloo ranks with the
  rank variables torchrun sets, for a reference run that a test compares a real launch with.

What needs a real launch stays on ``subprocess``: a test of torchrun or kiln's launcher, the
installed ``kiln`` script itself, a fresh interpreter or environment.
"""

from __future__ import annotations

import atexit
import functools
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import multiprocessing.util
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import weakref
from pathlib import Path

import torch.multiprocessing

from tests.parallelisms.tiny import free_port, rank_vars

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


def python_target(argv: list[str], env: dict[str, str] | None = None,
                  code: bool = False) -> list[str] | None:
    """``[script, *args]`` or ``["-m", module, *args]`` when ``argv`` runs this environment's
    Python (``sys.executable``, or ``python`` found first on PATH in this environment's bin
    folder) on a file or a module, and with ``code`` ``["-c", code, *args]``; None for anything
    else (another interpreter, other options)."""
    if not argv:
        return None
    path = (env or os.environ).get("PATH")
    found = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=path)
    if not found or Path(found).parent != Path(sys.executable).parent:
        return None
    if len(argv) > 2 and (argv[1] == "-m" or code and argv[1] == "-c") \
            or len(argv) > 1 and argv[1].endswith(".py"):
        return argv[1:]
    return None


def _main(argv: list[str]) -> int | str | None:
    """Run the command line in this process, as its own process would (``kiln``'s console
    script, run_train.sh on one process, or Python on a script or ``-m`` module)."""
    target = python_target(argv, code=True)
    if target is None:  # kiln ARGS, or run_train.sh ARGS: `exec python -m kiln.recipes.cli train`
        args = argv[1:] if argv[0] == "kiln" else ["train", *argv[1:]]
        sys.argv = ["kiln", *args]
        from kiln.recipes.cli import main

        return main(args)
    if target[0] == "-m":
        sys.argv = ["-m", *target[2:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
    elif target[0] == "-c":
        sys.argv = ["-c", *target[2:]]
        sys.path.insert(0, "")
        exec(compile(target[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = target
        sys.path.insert(0, str(Path(target[0]).resolve().parent))
        runpy.run_path(target[0], run_name="__main__")
    return 0


def _run_command(argv: list[str], cwd: str, env: dict[str, str], out: str | None,
                 err: str | None) -> None:
    """In the child: what the command line does (``_main``), with the exit status a process
    would have (an uncaught exception: its traceback and 1). Output to the files ``out`` and
    ``err`` (None: the inherited stream)."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, out), (2, err)):
        if path is not None:
            os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)
    # Python commands this one starts are forked too (kiln sweep's runs, a benchmark's sides)
    subprocess.run, subprocess.call = _forking_run, _forking_call
    try:
        code = _main(argv)
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


_REAL_RUN, _REAL_CALL = subprocess.run, subprocess.call
_PLAIN = {"capture_output", "text", "cwd", "env", "timeout", "check", "preexec_fn"}


def _forking_run(args, **kw):
    """``subprocess.run`` in a forked command: a Python command line with plain options runs
    in a child forked from this process (which has done no parallel work: one thread, no
    OpenMP pool), anything else as a process."""
    if isinstance(args, str) or set(kw) - _PLAIN or python_target(list(args), kw.get("env")) \
            is None:
        return _REAL_RUN(args, **kw)
    argv, timeout = list(args), kw.get("timeout")
    env = dict(os.environ if kw.get("env") is None else kw["env"])
    with tempfile.TemporaryDirectory(prefix="kiln-forked-") as tmp:
        out = err = None
        if kw.get("capture_output"):
            out, err = str(Path(tmp, "stdout")), str(Path(tmp, "stderr"))
            Path(out).touch()
            Path(err).touch()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            try:
                _forget_the_parent()
                if kw.get("preexec_fn"):
                    kw["preexec_fn"]()
                _run_command(argv, str(kw.get("cwd") or os.getcwd()), env, out, err)
            finally:
                os._exit(1)
        code = _reap(pid, timeout, argv)
        text = kw.get("text")
        stdout, stderr = ((_text(Path(f)) if text else Path(f).read_bytes()) if f else None
                          for f in (out, err))
    if kw.get("check") and code:
        raise subprocess.CalledProcessError(code, argv, stdout, stderr)
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


def _forget_the_parent() -> None:
    """In a child forked by ``_forking_run``, what multiprocessing does in the children it
    forks: the parent's finalizers and child processes are not this process's (its exit would
    otherwise remove the parent's temporary folders)."""
    weakref.finalize._registry.clear()
    multiprocessing.util._finalizer_registry.clear()
    multiprocessing.process._children.clear()


def _forking_call(args, **kw) -> int:
    if set(kw) - (_PLAIN - {"capture_output", "text", "check"}):
        return _REAL_CALL(args, **kw)
    return _forking_run(args, **kw).returncode


def _reap(pid: int, timeout: float | None, argv: list[str]) -> int:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if deadline is not None and time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise subprocess.TimeoutExpired(argv, timeout)
        time.sleep(0.02)


def processes(argv: list[str], env: dict[str, str] | None = None) -> int:
    """How many processes the command line starts: ``NGPU`` for run_train.sh, else 1; 0 where
    ``kiln`` cannot fork it (several nodes, a thread setting, an unknown program)."""
    env = env or {}
    if any(key in env for key in ("NNODES", "OMP_NUM_THREADS")):
        return 0
    if argv[0] == "kiln":
        return 0 if "NGPU" in env else 1
    if python_target(argv, code=True) is not None:
        return 1
    if Path(argv[0]).name != "run_train.sh":
        return 0
    ngpu = env.get("NGPU", "1")
    return int(ngpu) if ngpu.isdigit() and int(ngpu) >= 1 else 0


def is_forkable(argv: list[str], env: dict[str, str] | None = None) -> bool:
    """Whether ``run`` runs this command line in forked children: a kiln command, Python on a
    script, module or ``-c`` code, or run_train.sh on one node (``NGPU=N``: N gloo ranks, as
    torchrun would start)."""
    return processes(argv, env) > 0


def run(argv: list[str], cwd: Path | str, env: dict[str, str] | None = None,
        timeout: float = 1800) -> subprocess.CompletedProcess:
    """Run a command line (``is_forkable``) in children forked from the server with the
    environment ``env`` (default: this process's); its output and exit status.

    ``NGPU=N ./run_train.sh`` forks N ranks with the variables torchrun gives its workers and
    answers as ``run_train.sh`` does: the output of rank ``LOG_RANK`` (0), the first failed
    rank's status, the other ranks stopped once one fails. torchrun itself, and kiln's launcher
    around it, are tested on real launches (tests/parallelisms/test_run_train.py,
    tests/recipes/runs/test_launch.py)."""
    return start(argv, cwd, env).wait(timeout)


def start(argv: list[str], cwd: Path | str, env: dict[str, str] | None = None) -> Started:
    """``run`` without waiting: the processes are running when this returns."""
    env = dict(os.environ if env is None else env)
    assert is_forkable(argv) and "NNODES" not in env, argv
    nprocs = int(env.get("NGPU", "1")) if Path(argv[0]).name == "run_train.sh" else 1
    port = free_port() if nprocs > 1 else 0
    started = Started(argv, int(env.get("LOG_RANK", "0")))
    for rank in range(nprocs):
        out, err = started.files(rank)
        rank_env = env if nprocs == 1 else {**env, **rank_vars(rank, nprocs, port)}
        child = _context().Process(target=_run_command, args=(list(argv), str(cwd), rank_env,
                                                              str(out), str(err)))
        child.start()
        started.children.append(child)
    return started


class Started:
    """A command line's forked processes (one per rank) and their output files."""

    def __init__(self, argv: list[str], shown: int) -> None:
        self.argv, self.shown, self.children = argv, shown, []
        self._tmp = Path(tempfile.mkdtemp(prefix="kiln-forked-"))

    def files(self, rank: int) -> tuple[Path, Path]:
        out, err = self._tmp / f"stdout{rank}", self._tmp / f"stderr{rank}"
        out.touch()
        err.touch()
        return out, err

    @property
    def pids(self) -> list[int]:
        """The processes' ids, rank order."""
        return [child.pid for child in self.children]

    def poll(self) -> int | None:
        """None while a process runs, else the first failed one's status (or 0)."""
        codes = [child.exitcode for child in self.children]
        return None if None in codes else next((code for code in codes if code), 0)

    def output(self, rank: int | None = None) -> str:
        """What rank ``rank`` (default: the shown one) has written to stdout so far."""
        return _text(self._tmp / f"stdout{self.shown if rank is None else rank}")

    def wait(self, timeout: float = 1800) -> subprocess.CompletedProcess:
        """Wait for the processes; their output and status as ``run`` returns them (all are
        killed on a timeout, which raises ``subprocess.TimeoutExpired``)."""
        try:
            failed = _wait(self.children, timeout, self.shown)
            out, err = (_text(self._tmp / f"{name}{self.shown}") for name in ("stdout", "stderr"))
            if failed is None:
                for child in self.children:
                    child.kill()
                    child.join()
                raise subprocess.TimeoutExpired(self.argv, timeout, out, err)
            if failed != self.shown and self.children[failed].exitcode:
                # the failed rank's message, unless the shown rank printed the same one before
                # it was stopped (both ranks hit the same bad recipe: shown once, as kiln's
                # launcher shows it)
                theirs = _text(self._tmp / f"stderr{failed}")
                if not theirs.strip() or theirs.strip() not in err:
                    err += f"[rank {failed}]\n" + theirs
            # Like subprocess: -N when signal N ended the child.
            return subprocess.CompletedProcess(self.argv, self.children[failed].exitcode, out,
                                               err)
        finally:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _wait(children: list, timeout: float, shown: int = 0) -> int | None:
    """Wait for every child; once one fails, stop the others (as torchrun does). The index
    whose status counts (the first failure, else the shown rank), None on a timeout. Ranks
    seen failed together (each gave the same bad recipe, say) count as the shown one when it is
    among them, so its message is the one shown, once, as kiln's launcher shows one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [c.exitcode for c in children]
        if any(codes):
            failed = [i for i, code in enumerate(codes) if code]
            first = shown if shown in failed else failed[0]
            for child in children:
                if child.exitcode is None:
                    child.kill()
                child.join()
            return first
        if all(code == 0 for code in codes):
            return 0
        multiprocessing.connection.wait([c.sentinel for c in children if c.exitcode is None],
                                        timeout=min(1.0, deadline - time.monotonic()))
    return None


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
    logs.mkdir(parents=True, exist_ok=True)
    spawn(_train_rank, args=(nprocs, free_port(), list(args), str(logs)), nprocs=nprocs)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")

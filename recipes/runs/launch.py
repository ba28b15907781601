"""``python -m kiln.recipes.runs.launch [torchrun options] -m kiln.recipes.cli train RECIPE ...``:
torchrun with kiln's error reporting (``NGPU=N ./run_train.sh`` uses it).

torchrun reports a failed worker as a ``ChildFailedError`` traceback and exits 1, whatever the
worker said; its log filter (``--local-ranks-filter``) may also hide the rank that failed. Here
each rank that stops on an error leaves a small JSON report in a folder named by
``KILN_ERROR_DIR`` (written by ``kiln.recipes.cli``) instead of printing it, and this launcher
prints one message for the whole run:

- a kiln error (bad recipe, incompatible checkpoint, ...) on any rank: the first one, as
  ``kiln train: error: ...``, exiting with kiln's status (2 for recipe and checkpoint errors);
  other ranks' failures are its consequences (peers vanish from collectives) and are not shown;
- no kiln error, but a rank killed by a signal (kill -9, the out-of-memory killer, a crash):
  that rank and the signal; the other ranks' errors ("Connection reset by peer" from a
  collective it left) are its consequences and get one line each, status 1;
- no kiln error, but a Python exception: that rank's traceback (a bug to report), status 1;
- a worker exiting without a report: one line naming rank and exit code.

Workers die with their launcher. torchrun starts each worker in its own process session (so it
can stop a worker's whole process group), so ``kill -9 -PGID`` of ``run_train.sh`` or an
out-of-memory kill of the launcher would leave the workers training on, unseen. Each worker
asks the kernel for SIGKILL when the launcher dies (``bind_to_launcher``: ``PR_SET_PDEATHSIG``;
no thread, no polling, and it works whichever way the launcher goes). SIGKILL rather than
SIGTERM: torchrun follows its own SIGTERM with SIGKILL after 30 s, but with the launcher gone
nobody would for a worker stuck in a collective, and whoever kills a launcher with -9 wants the
job stopped now. A graceful stop is SIGTERM or Ctrl-C to the launcher: torchrun passes it on and
the workers save a checkpoint first (``[checkpoint] preemption``). Linux only; elsewhere workers
outlive a killed launcher as under plain torchrun.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

ERROR_DIR = "KILN_ERROR_DIR"
LAUNCHER_PID = "KILN_LAUNCHER_PID"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def report_path(rank: int | str) -> Path | None:
    """Where a worker writes its error report (None when not launched by this module)."""
    folder = os.environ.get(ERROR_DIR)
    return Path(folder) / f"rank_{int(rank):05d}.json" if folder else None


def write_report(report: dict) -> bool:
    """Called by a failing worker; False when it should print the error itself."""
    path = report_path(os.environ.get("RANK", "0"))
    if path is None:
        return False
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report), encoding="utf-8")
    os.replace(tmp, path)  # the launcher never reads half a report
    return True


def read_reports(folder: Path) -> list[dict]:
    """Every rank's report, first written first."""
    reports = []
    for path in sorted(folder.glob("rank_*.json")):
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        report["rank"] = int(path.stem.split("_")[1])
        report["at"] = path.stat().st_mtime_ns
        reports.append(report)
    return sorted(reports, key=lambda r: (r["at"], r["rank"]))


def bind_to_launcher() -> None:
    """In a worker started by this launcher: die (SIGKILL) when the launcher dies (module doc)."""
    pid = os.environ.pop(LAUNCHER_PID, None)  # popped: the worker's own children are not bound
    if pid is not None:
        die_with_parent(int(pid))


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent, ``parent``, dies (``PR_SET_PDEATHSIG``, kept across
    exec). Also a ``preexec_fn`` (``kiln sweep``'s training runs). Linux only."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not allowed here (a sandbox): the worker runs unbound, as under plain torchrun
    if os.getppid() != parent:  # the parent died before the request: nobody will signal
        os.kill(os.getpid(), signal.SIGKILL)


def summarize(reports: list[dict], failures: dict[int, tuple[int, str]]) -> tuple[str, int]:
    """(message, exit status) for a failed launch. ``failures``: rank -> (exit code, torchrun's
    description) of the workers torchrun saw fail, first failure first."""
    kiln = [r for r in reports if r.get("kind") == "kiln"]
    if kiln:
        first = kiln[0]
        return f"{first['prefix']}: error: {first['message']}", int(first["exit_code"])
    crashed = [r for r in reports if r.get("kind") == "exception"]
    reported = {r["rank"] for r in reports}
    killed = [(rank, code, what) for rank, (code, what) in failures.items()
              if code < 0 and rank not in reported]
    if killed:
        oom = "; the kernel's out-of-memory killer sends SIGKILL too: see `dmesg`"
        lines = [f"kiln: rank {rank} {what} (exit code {code})"
                 f"{oom if code == -signal.SIGKILL else ''}" for rank, code, what in killed]
        lines += [f"kiln: rank {r['rank']} failed after it: {_last_line(r['traceback'])}"
                  for r in crashed]
        return "\n".join(lines), 1
    if crashed:
        first = crashed[0]
        return f"rank {first['rank']} failed:\n{first['traceback'].rstrip()}", 1
    if failures:
        rank, (code, what) = next(iter(failures.items()))
        return f"kiln: rank {rank} {what} (exit code {code}) without an error report", 1
    return "kiln: the launch failed without an error report", 1


def _last_line(traceback: str) -> str:
    lines = [line for line in traceback.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "(no message)"


def _describe(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return "exited"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    # Worker start/stop lines ("failed (exitcode: 2)", "Sending process ... closing signal"):
    # the failure is reported below, once.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="kiln-errors-") as folder:
        os.environ[ERROR_DIR] = folder
        os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers' parent: bind_to_launcher
        try:
            run(args)
            return 0
        except ChildFailedError as exc:
            failed = exc.failures  # rank -> ProcessFailure
            failures = {r: (failed[r].exitcode, _describe(failed[r].exitcode))
                        for r in sorted(failed, key=lambda r: failed[r].timestamp)}
            message, status = summarize(read_reports(Path(folder)), failures)
        except SignalException as exc:
            message, status = f"kiln: stopped by {exc.sigval.name}", 128 + int(exc.sigval)
    sys.stdout.flush()
    print(message, file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())

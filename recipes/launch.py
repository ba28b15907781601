"""``python -m kiln.recipes.launch [torchrun options] -m kiln.recipes.cli train RECIPE ...``:
torchrun with kiln's error reporting (``NGPU=N ./run_train.sh`` uses it).

torchrun reports a failed worker as a ``ChildFailedError`` traceback and exits 1, whatever the
worker said; its log filter (``--local-ranks-filter``) may also hide the rank that failed. Here
each rank that stops on an error leaves a small JSON report in a folder named by
``KILN_ERROR_DIR`` (written by ``kiln.recipes.cli``) instead of printing it, and this launcher
prints one message for the whole run:

- a kiln error (bad recipe, incompatible checkpoint, ...) on any rank: the first one, as
  ``kiln train: error: ...``, exiting with kiln's status (2 for recipe and checkpoint errors);
  other ranks' failures are its consequences (peers vanish from collectives) and are not shown;
- no kiln error, but a Python exception: that rank's traceback (a bug to report), status 1;
- a worker killed by a signal or exiting without a report: one line naming rank and cause.
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


def summarize(reports: list[dict], failures: dict[int, tuple[int, str]]) -> tuple[str, int]:
    """(message, exit status) for a failed launch. ``failures``: rank -> (exit code, torchrun's
    description) of the workers torchrun saw fail, first failure first."""
    kiln = [r for r in reports if r.get("kind") == "kiln"]
    if kiln:
        first = kiln[0]
        return f"{first['prefix']}: error: {first['message']}", int(first["exit_code"])
    crashed = [r for r in reports if r.get("kind") == "exception"]
    if crashed:
        first = crashed[0]
        return f"rank {first['rank']} failed:\n{first['traceback'].rstrip()}", 1
    if failures:
        rank, (code, what) = next(iter(failures.items()))
        return f"kiln: rank {rank} {what} (exit code {code}) without an error report", 1
    return "kiln: the launch failed without an error report", 1


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

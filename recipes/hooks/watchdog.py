"""The hang watchdog (``[run.watchdog]``): a step that takes far longer than usual is a hang.

A thread on every rank watches the trainer's step window (data + step function; the hooks --
evaluation, checkpoint saves -- are outside it, a hung collective there meets the process
group's ``parallelism.collective_timeout_s``). When the open step has run longer than the
threshold -- ``factor`` x the median of the recent steps, at least ``min_s``, or ``timeout_s``
when set -- the rank

1. writes ``RUN/hang/trigger.json`` (the first rank to fire), which makes every other rank's
   watchdog fire at its next poll whatever it is doing, so that every rank dumps;
2. dumps the Python stacks of all its threads (``faulthandler``) to ``RUN/hang/rank_N.txt``,
   after a JSON header line: its steps done, the collectives it issued per process group (from
   the flight recorder), and whether its main thread waits inside ``torch.distributed``; and
   torch's flight recorder itself (the process groups' last collectives,
   ``parallelism.flight_recorder``) to ``RUN/hang/rank_N.flight_recorder.json``;
3. waits (at most ``grace_s``) for every rank's dump, names the slowest rank (``slowest``) and
   exits at once with status 3 (``TrainingHung``) and that message, so that the scheduler
   restarts the run and the resume continues from the last checkpoint.

The watchdog arms after the first step (which compiles, warms up and initialises lazily). A
``RUN/hang/`` left by an earlier hang is renamed ``RUN/hang_<time>/`` when training starts.
"""

from __future__ import annotations

import faulthandler
import json
import os
import statistics
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

from pydantic import Field

from kiln.checkpointing.layout import write_atomic
from kiln.components import distributed
from kiln.components.base import ComponentConfig
from kiln.components.errors import KilnError, TrainingHung
from kiln.components.protocols import Hook
from kiln.components.registry import register

TRIGGER = "trigger.json"


class WatchdogConfig(ComponentConfig):
    """``[run.watchdog]``: when a step counts as hung, and what happens then."""

    enable: bool = Field(True, description="watch every step for hangs")
    factor: float = Field(
        10.0, gt=1, description="a step running longer than factor x the median of the recent "
        "steps is a hang (unless timeout_s is set)"
    )
    min_s: float = Field(300.0, gt=0, description="never call a step hung before this many seconds")
    timeout_s: float = Field(
        0.0, ge=0, description="a fixed threshold in seconds instead of factor x median (0 = use "
        "factor)"
    )
    grace_s: float = Field(
        60.0, ge=0, description="after its own dump, how long a rank waits for the others' "
        "before it exits"
    )
    poll_s: float = Field(2.0, gt=0, description="how often the watchdog looks, in seconds")


def slowest(headers: dict[int, dict | None]) -> tuple[list[int], str]:
    """The ranks holding the others up, and why, from every rank's dump header (None: no dump).
    A rank without a dump first (it is frozen, dead or cannot write); then the fewest steps
    done; among equals, the fewest collectives issued (flight recorder: on CUDA collectives are
    asynchronous, so a rank waiting for a peer blocks at its next synchronisation, not inside
    torch.distributed); then ranks not waiting in a collective while another waits."""
    missing = [r for r, h in headers.items() if h is None]
    if missing:
        return missing, "wrote no dump (frozen, killed, or its run folder is elsewhere)"
    least = min(h["done"] for h in headers.values())
    behind = [r for r, h in headers.items() if h["done"] == least]
    if len(behind) < len(headers):
        return behind, f"{least} steps done while the others finished step {least + 1}"
    issued = {r: _issued(headers[r], headers.values()) for r in behind}
    if len(set(issued.values())) > 1:
        fewest = min(issued.values())
        return [r for r in behind if issued[r] == fewest], (
            f"issued {fewest} collectives where the others issued up to "
            f"{max(issued.values())} (flight recorder)")
    computing = [r for r in behind if not headers[r]["in_collective"]]
    if computing and len(computing) < len(behind):
        where = "; ".join(f"rank {r}: {headers[r]['where']}" for r in computing)
        return computing, f"not in a collective while the others wait in one ({where})"
    if computing:
        return computing, "every rank is outside a collective (a hang in compute or input)"
    return behind, ("every rank waits in a collective: a mismatched collective or a network "
                    "fault; compare the flight recorder files")


def _issued(header: dict, everyone) -> int:
    """Collectives ``header``'s rank issued on the process groups every rank reported."""
    common = set.intersection(*(set(h.get("collectives", {})) for h in everyone))
    return sum(header["collectives"][name] for name in common)


def collectives_issued(trace: str | None) -> dict[str, int]:
    """The highest collective sequence number per process group in a flight recorder dump."""
    issued: dict[str, int] = {}
    try:
        entries = json.loads(trace)["entries"] if trace else []
    except (ValueError, KeyError, TypeError):
        return issued
    for e in entries:
        name = "/".join(map(str, e.get("process_group", ["?"])))
        issued[name] = max(issued.get(name, 0), int(e.get("collective_seq_id", 0)))
    return issued


def main_thread_position() -> tuple[bool, str]:
    """(whether the main thread is inside torch.distributed, the innermost frame outside
    torch: where it is)."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    inside, where = False, "unknown"
    marker = os.sep + os.path.join("torch", "distributed") + os.sep
    torch_dir = os.sep + "torch" + os.sep
    while frame is not None:
        name = frame.f_code.co_filename
        inside = inside or marker in name
        if where == "unknown" and torch_dir not in name:
            where = f"{name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return inside, where


@register("hook", "watchdog", config=WatchdogConfig)
class Watchdog(Hook):
    """A step far slower than usual is a hang. The step window opens in ``on_step_start`` and
    closes in ``on_step_end``; the watching thread runs from ``on_train_start`` to ``close``."""

    priority = 100  # the step window closes before other hooks work

    def __init__(self, cfg: WatchdogConfig, *, exit=os._exit) -> None:
        self.cfg = cfg
        self.exit = exit
        self.durations: deque[float] = deque(maxlen=100)
        self.done = 0  # steps this process completed (this invocation's count + the resume's)
        self.begun: float | None = None  # when the open step window began
        self.first = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False

    # ------------------------------------------------------------------ the trainer's calls
    def on_step_start(self, trainer) -> None:
        self.step_begins()

    def on_step_end(self, trainer, result) -> None:
        self.step_ends(trainer.progress.step)

    def step_begins(self) -> None:
        self.begun = time.monotonic()

    def step_ends(self, done: int) -> None:
        if self.begun is not None and not self.first:  # the first step warms up: not a sample
            self.durations.append(time.monotonic() - self.begun)
        self.first, self.begun, self.done = False, None, done

    def threshold(self) -> float | None:
        """Seconds the open step may take, None while unarmed."""
        if self.first:
            return None
        if self.cfg.timeout_s:
            return self.cfg.timeout_s
        if not self.durations:
            return None
        return max(self.cfg.min_s, self.cfg.factor * statistics.median(self.durations))

    # ------------------------------------------------------------------------- the hook part
    def on_train_start(self, trainer) -> None:
        if not self.cfg.enable:
            return
        self.done = trainer.progress.step
        self.folder = Path(trainer.run_dir) / "hang"
        self.rank, self.world_size = trainer.world.rank, trainer.world.world_size
        self.device = str(trainer.device)
        self.started_wall = time.time()
        if trainer.world.is_main and self.folder.is_dir():  # an earlier hang's dumps
            stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(self.folder.stat().st_mtime))
            self.folder.rename(self.folder.with_name(f"hang_{stamp}"))
        self._thread = threading.Thread(target=self._watch, name="kiln-watchdog", daemon=True)
        self._thread.start()

    def close(self, trainer) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    # -------------------------------------------------------------------------- the thread
    def _watch(self) -> None:
        while not self._stop.wait(self.cfg.poll_s):
            begun, limit = self.begun, self.threshold()
            if begun is not None and limit is not None and time.monotonic() - begun > limit:
                self.fire(f"step {self.done + 1} made no progress for "
                          f"{time.monotonic() - begun:.0f} s (limit {self._rule(limit)})")
                return
            if self._triggered():
                self.fire(None)
                return

    def _rule(self, limit: float) -> str:
        if self.cfg.timeout_s:
            return f"run.watchdog.timeout_s = {self.cfg.timeout_s:g} s"
        return (f"{limit:.0f} s = run.watchdog.factor {self.cfg.factor:g} x the median step "
                f"{statistics.median(self.durations):.2f} s, at least min_s {self.cfg.min_s:g}")

    def _triggered(self) -> bool:
        trigger = self.folder / TRIGGER
        try:
            return trigger.stat().st_mtime >= self.started_wall - 1.0
        except OSError:
            return False

    def fire(self, reason: str | None) -> None:
        """Dump, wait for the others' dumps, name the slowest rank, exit 3. Where the run folder
        cannot be written, the stacks go to stderr and the run exits 3 all the same."""
        self.fired = True
        try:
            self._fire(reason)
        except (OSError, ValueError, KeyError) as exc:  # unwritable folder, unreadable trigger
            print(_stacks(), file=sys.stderr)
            _leave(TrainingHung(f"hang: {reason or 'another rank saw one'}; the dumps could not "
                                f"be written ({exc}): this rank's stacks are on stderr"),
                   self.exit)

    def _fire(self, reason: str | None) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        if reason is not None and not (self.folder / TRIGGER).exists():
            write_atomic(self.folder / TRIGGER, json.dumps({"rank": self.rank,
                                                             "reason": reason}))
        if reason is None:
            reason = json.loads((self.folder / TRIGGER).read_text(encoding="utf-8"))["reason"]
            reason = f"{reason} (seen by another rank)"
        self._dump()
        headers = self._gather()
        ranks, why = slowest(headers)
        named = ", ".join(f"rank {r}" + (f" ({headers[r]['host']}, {headers[r]['device']})"
                                         if headers[r] else "") for r in ranks)
        message = (f"hang: {reason}; slowest: {named}: {why}. Python stacks of every rank in "
                   f"{self.folder}/rank_N.txt (torch's flight recorder beside them). The run "
                   "resumes from its last checkpoint when restarted")
        _leave(TrainingHung(message), self.exit)

    def _dump(self) -> None:
        import socket

        in_collective, where = main_thread_position()
        trace = _flight_recorder()
        header = {"rank": self.rank, "host": socket.gethostname(), "device": self.device,
                  "done": self.done, "in_collective": in_collective, "where": where,
                  "collectives": collectives_issued(trace),
                  "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        path = self.folder / f"rank_{self.rank}.txt"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(json.dumps(header) + "\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        os.replace(tmp, path)
        if trace is not None:
            write_atomic(self.folder / f"rank_{self.rank}.flight_recorder.json", trace)

    def _gather(self) -> dict[int, dict | None]:
        deadline = time.monotonic() + self.cfg.grace_s
        paths = {r: self.folder / f"rank_{r}.txt" for r in range(self.world_size)}
        while not all(p.exists() for p in paths.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        headers: dict[int, dict | None] = {}
        for r, p in paths.items():
            try:
                headers[r] = json.loads(p.read_text(encoding="utf-8").split("\n", 1)[0])
            except (OSError, ValueError):
                headers[r] = None
        return headers


def _stacks() -> str:
    """Every thread's Python stack as text (faulthandler needs a real file)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return "\n".join(f"Thread {names.get(ident, ident)} (most recent call last):\n"
                     + "".join(traceback.format_stack(frame))
                     for ident, frame in sys._current_frames().items())


def dump_flight_recorder(folder: Path, rank: int) -> Path | None:
    """After a collective failed (a peer gone or stopped past ``collective_timeout_s``, e.g.
    during a checkpoint save, which the watchdog does not watch): torch's flight recorder to
    ``folder/rank_N.flight_recorder.json``, as a hang leaves it. None without one."""
    trace = _flight_recorder()
    if trace is None:
        return None
    path = folder / f"rank_{rank}.flight_recorder.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(path, trace)
    except OSError as exc:  # the failure being reported matters more than its record
        print(f"kiln: WARNING: could not write {path} ({exc.strerror})", file=sys.stderr)
        return None
    return path


def _flight_recorder() -> str | None:
    """torch's flight recorder as JSON (NCCL's own on CUDA builds), None without a process
    group or where this torch has none."""
    if not distributed.is_initialized():
        return None
    import torch

    c10d = torch._C._distributed_c10d
    for name in ("_dump_nccl_trace_json", "_dump_fr_trace_json"):
        dump = getattr(c10d, name, None)
        if dump is None:
            continue
        try:
            return dump().decode("utf-8", "replace")
        except RuntimeError:
            continue  # e.g. no NCCL group in this process
    return None


def _leave(error: KilnError, exit) -> None:
    """Report like the CLI (one message; the launcher's report file under torchrun) and leave
    at once: the main thread is stuck and cannot unwind."""
    from kiln.recipes.runs import launch

    report = {"kind": "kiln", "prefix": "kiln train", "exit_code": error.exit_code,
              "message": str(error)}
    if not launch.write_report(report):
        print(f"kiln train: error: {error}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    exit(error.exit_code)

"""Elastic resume and unattended recovery, end to end on the real ``debug.toml`` (issue 13's
acceptance): ``python scripts/elastic_check.py [--steps 100] [--cut 60] [--work DIR]``.

1. ``NGPU=2 ./run_train.sh train_configs/debug.toml --training.steps=100`` stopped by SIGTERM near
   step 60 (the training processes are signalled; they save at the next step boundary and exit
   0), then the same command with 1 process continues it; its final loss is compared with the
   uninterrupted 2-process run (rtol 1e-5). Then the same the other way round (1 -> 2).
2. A 2-process run saving every 20 steps (3 kept) is stopped near step 60, one byte of its newest
   snapshot is flipped, and the same command reruns: it must say RECOVERED, resume from the
   second-newest snapshot and end with every loss of the uninterrupted 2-process run.

Each run has its own folder under ``--work`` (default: a temporary folder; a finished reference
run there is reused); ``--checks`` picks some of ``2to1 1to2 recovery``. Prints one line per
check and exits 1 if any fails. CPU only is fine (2 gloo processes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "train_configs" / "debug.toml"
SAVE_OFTEN = ("--checkpoint.interval=20", "--checkpoint.keep_last=3")


def losses(run: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def _command(nproc: int, steps: int, extra: tuple[str, ...]) -> list[str]:
    return [str(REPO / "run_train.sh"), str(RECIPE), f"--training.steps={steps}", *extra]


def train(cwd: Path, nproc: int, steps: int, *extra: str) -> str:
    """One run in ``cwd`` (its run folder is cwd/runs/debug); returns its console text."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NGPU": str(nproc)}
    done = subprocess.run(_command(nproc, steps, extra), cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    (cwd / f"console_{nproc}.txt").write_text(done.stdout)
    if done.returncode != 0:
        sys.exit(f"{cwd}: exit {done.returncode}\n{done.stdout[-3000:]}")
    return done.stdout


def _workers(proc: subprocess.Popen, nproc: int) -> list[int]:
    """The training processes: run_train.sh execs python (1) or torchrun, whose children train."""
    if nproc == 1:
        return [proc.pid]
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], text=True, capture_output=True,
                           check=False).stdout.split()
    return [int(p) for p in found]


def cut(cwd: Path, nproc: int, steps: int, near: int, *extra: str) -> int:
    """Start the run, SIGTERM its training processes when the log says step ~``near`` is close
    (log every step), wait for the clean exit; returns the step it saved."""
    cwd.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "NGPU": str(nproc)}
    run = cwd / "runs" / "debug"
    proc = subprocess.Popen(_command(nproc, steps, ("--run.log_interval=1", *extra)), cwd=cwd,
                            env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if (run / "metrics.jsonl").is_file() and max(losses(run), default=0) >= near - 1:
            for pid in _workers(proc, nproc):
                os.kill(pid, signal.SIGTERM)
            break
    lines += proc.stdout.readlines()
    rc = proc.wait()
    (cwd / f"console_cut_{nproc}.txt").write_text("".join(lines))
    if rc != 0:
        sys.exit(f"{cwd}: the cut run exited {rc}\n{''.join(lines)[-3000:]}")
    saved = (run / "checkpoints" / "latest").read_text().strip()
    return int(saved.split("_")[1])


def check(name: str, ok: bool, detail: str) -> bool:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


def elastic(work: Path, a: int, b: int, steps: int, near: int, full: dict[int, dict]) -> bool:
    folder = work / f"cut{a}_resume{b}"
    shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    k = cut(folder, a, steps, near)
    out = train(folder, b, steps)
    got, want = losses(folder / "runs" / "debug")[steps], full[a][steps]
    rel = abs(got - want) / abs(want)
    said = "resumed on a different layout" in out
    return check(f"{a} -> {b} processes", rel <= 1e-5 and said and math.isfinite(got),
                 f"cut at step {k}, final loss {got:.7f} vs uninterrupted {a}-process "
                 f"{want:.7f} (rel {rel:.1e}); layout change reported: {said} "
                 f"({time.perf_counter() - start:.0f} s)")


def recovery(work: Path, steps: int, near: int, full2: dict[int, float]) -> bool:
    folder = work / "corrupt"
    shutil.rmtree(folder, ignore_errors=True)
    cut(folder, 2, steps, near, *SAVE_OFTEN)
    ck = folder / "runs" / "debug" / "checkpoints"
    snaps = sorted(p.name for p in ck.glob("step_*"))
    newest = ck / snaps[-1]
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    out = train(folder, 2, steps, *SAVE_OFTEN)
    got = losses(folder / "runs" / "debug")
    said = f"RECOVERED from 1 corrupt snapshot(s): resuming from {snaps[-2]}" in out
    moved = (ck / "corrupt" / snaps[-1]).is_dir()
    same = {s: got[s] for s in full2} == full2
    return check("corrupt newest of three snapshots", said and moved and same,
                 f"snapshots {snaps}, {snaps[-1]} corrupted; recovered from {snaps[-2]} and "
                 f"said so: {said}; moved to corrupt/: {moved}; losses equal to the "
                 f"uninterrupted run at every logged step: {same}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--cut", type=int, default=60, help="stop near this step")
    ap.add_argument("--work", type=Path, default=None, help="folder for the runs")
    ap.add_argument("--checks", nargs="+", default=["2to1", "1to2", "recovery"],
                    choices=["2to1", "1to2", "recovery"])
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="kiln-elastic-"))
    print(f"runs in {work}", flush=True)
    full, ok = {}, True
    for a, b in ((2, 1), (1, 2)):  # each direction right after its reference run
        if f"{a}to{b}" in args.checks:
            full[a] = uninterrupted(work / f"full{a}", a, args.steps)
            ok &= elastic(work, a, b, args.steps, args.cut, full)
    if "recovery" in args.checks:
        full[2] = full.get(2) or uninterrupted(work / "full2", 2, args.steps)
        ok &= recovery(work, args.steps, args.cut, full[2])
    return 0 if ok else 1


def uninterrupted(folder: Path, nproc: int, steps: int) -> dict[int, float]:
    """The reference run (kept: a rerun with the same --work reuses a finished one)."""
    run = folder / "runs" / "debug"
    start = time.perf_counter()
    if not (run / "metrics.jsonl").is_file() or steps not in losses(run):
        shutil.rmtree(folder, ignore_errors=True)
        train(folder, nproc, steps)
    got = losses(run)
    print(f"uninterrupted {nproc}-process run: final loss {got[steps]:.7f} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    return got


if __name__ == "__main__":
    sys.exit(main())

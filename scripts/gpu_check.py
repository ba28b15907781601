"""Train one recipe briefly in three numerics setups and print tokens/s, MFU and peak memory.

Each setup is one `kiln bench RECIPE --json` process (so compile caches and CUDA memory do not
leak between rows); a failed setup prints its error tail and stays in the table as "failed".

    python scripts/gpu_check.py [--recipe train_configs/gpu_1b.toml] [--steps 30] [--warmup 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SETUPS = [
    ("bf16 eager", ["--parallelism.compile=false", "--parallelism.float8=off"]),
    ("bf16 + compile", ["--parallelism.compile=true", "--parallelism.float8=off"]),
    ("fp8 rowwise + compile", ["--parallelism.compile=true", "--parallelism.float8=rowwise"]),
]


def command(recipe: str, steps: int, warmup: int, ngpu: int, extra: list[str]) -> list[str]:
    bench = ["-m", "kiln.recipes.cli", "bench", recipe, "--steps", str(steps),
             "--warmup", str(warmup), "--json", *extra]
    if ngpu > 1:
        return ["torchrun", "--standalone", "--nnodes=1", f"--nproc-per-node={ngpu}", *bench]
    return [sys.executable, *bench]


def run_setup(cmd: list[str], timeout: int) -> tuple[dict | None, str]:
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout} s"
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line), ""
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    return None, f"exit {proc.returncode}:\n{tail}"


def table(rows: list[tuple[str, dict | None]]) -> str:
    head = ("setup", "tokens/s", "step ms", "MFU", "peak mem GiB", "first step s", "parallelism")
    lines = [head]
    for name, r in rows:
        if r is None:
            lines.append((name, "failed", "", "", "", "", ""))
            continue
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "n/a"
        lines.append((
            name, f"{r['tokens_per_second']:,.0f}", f"{r['step_time_s'] * 1000:.0f}", mfu,
            f"{r['peak_memory_bytes'] / 2**30:.1f}", f"{r['time_to_first_step_s']:.0f}",
            r.get("parallelism", ""),
        ))
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    out = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
           for row in lines]
    out.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="train_configs/gpu_1b.toml")
    ap.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 30)))
    ap.add_argument("--warmup", type=int, default=int(os.environ.get("WARMUP", 5)))
    ap.add_argument("--ngpu", type=int, default=int(os.environ.get("NGPU", 1)))
    ap.add_argument("--timeout", type=int, default=int(os.environ.get("SETUP_TIMEOUT", 300)),
                    help="seconds per setup")
    ap.add_argument("--only", default="", help="comma-separated setup numbers (1-3) to run")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args, extra = ap.parse_known_args(argv)  # the rest: --section.key=value for every setup
    chosen = [SETUPS[int(i) - 1] for i in args.only.split(",")] if args.only else SETUPS
    rows = []
    for name, overrides in chosen:
        cmd = command(args.recipe, args.steps, args.warmup, args.ngpu, [*overrides, *extra])
        print(f"== {name}: {' '.join(cmd)}", flush=True)
        if args.dry_run:
            continue
        start = time.perf_counter()
        result, error = run_setup(cmd, args.timeout)
        print(f"   {'ok' if result else 'FAILED'} in {time.perf_counter() - start:.0f} s"
              + (f"\n{error}" if error else ""), flush=True)
        rows.append((name, result))
    if rows:
        print()
        print(table(rows))
    return 0 if rows and all(r is not None for _, r in rows) else (0 if args.dry_run else 1)


if __name__ == "__main__":
    sys.exit(main())

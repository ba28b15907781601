"""Throughput and memory of ``kiln data prepare`` against bare ``tokenizers`` on the same files.

    python scripts/bench_prepare.py [--size-mb 1024] [--workers 1,2,4] [--tokenizer DIR]

1. Generates a JSONL corpus of ``--size-mb`` MB (documents cut from this machine's Python
   stdlib, seeded) under ``--tmp`` (default /tmp), in 64 MB files.
2. Baseline: one process reads the same files (``json.loads`` per line) and calls the
   ``tokenizers`` library's ``encode_batch_fast`` on 1 MB batches, with its own threads on every
   core: what a hand-written script would do.
3. ``kiln data prepare --input DIR --workers N`` for each N, as a subprocess, timed, with the
   peak of the summed RSS of its process tree (main + workers, sampled every 50 ms).
4. Prints one table with the CPU model and deletes everything it wrote (``--keep`` keeps it).

The tokenizer defaults to a 4,096-entry byte-level BPE trained on the stdlib (kiln's ``bpe``
tokenizer, cached under $KILN_CACHE).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

FILE_MB = 64


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return "unknown CPU"


def generate(folder: Path, size_mb: int, seed: int = 0) -> int:
    """JSONL files of documents (random slices of stdlib modules); returns the text bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    sources = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.glob("*.py"))]
    rnd = random.Random(seed)
    folder.mkdir(parents=True)
    total, index, target = 0, 0, size_mb * 1_000_000
    while total < target:
        with open(folder / f"part_{index:04d}.jsonl", "w", encoding="utf-8") as f:
            written = 0
            while written < FILE_MB * 1_000_000 and total < target:
                src = rnd.choice(sources)
                start = rnd.randrange(max(len(src) - 200, 1))
                text = src[start:start + rnd.randint(200, 20_000)]
                line = json.dumps({"text": text}) + "\n"
                f.write(line)
                written += len(line)
                total += len(text.encode("utf-8"))
        index += 1
    return total


def tree_rss(pid: int) -> int:
    """Summed resident memory (bytes) of ``pid`` and its descendants, from /proc."""
    total, stack = 0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, int]:
    """(wall seconds, peak tree RSS) of a command."""
    peak = [0]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    took = time.perf_counter() - t0
    sampler.join()
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out[-3000:]}")
    return took, peak[0]


BASELINE = """
import json, sys, time
from pathlib import Path
from tokenizers import Tokenizer
tok = Tokenizer.from_file(sys.argv[1])
t0, tokens = time.perf_counter(), 0
for path in sorted(Path(sys.argv[2]).glob("*.jsonl")):
    batch, size = [], 0
    with open(path, "rb") as f:
        for line in f:
            text = json.loads(line)["text"]
            batch.append(text)
            size += len(text)
            if size >= 1 << 20:
                tokens += sum(len(e.ids) for e in tok.encode_batch_fast(batch))
                batch, size = [], 0
    if batch:
        tokens += sum(len(e.ids) for e in tok.encode_batch_fast(batch))
print(tokens)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="corpus size (text MB)")
    parser.add_argument("--workers", default="", help="comma-separated worker counts "
                        "(default: 1, 2, 4, ... up to the CPU count)")
    parser.add_argument("--tokenizer", default="", help="tokenizer.json or folder (default: "
                        "kiln's bpe tokenizer, 4,096 entries, trained on the stdlib)")
    parser.add_argument("--tmp", default="/tmp", help="where the corpus and outputs go")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and outputs")
    args = parser.parse_args()
    cpus = os.cpu_count() or 1
    workers = [int(w) for w in args.workers.split(",")] if args.workers else sorted(
        {min(2 ** i, cpus) for i in range(cpus.bit_length() + 1)})
    if args.tokenizer:
        tok = Path(args.tokenizer)
        tok = tok / "tokenizer.json" if tok.is_dir() else tok
    else:
        from kiln.components.base import default_config

        tok = default_config("tokenizer", "bpe").build().file
    work = Path(tempfile.mkdtemp(prefix="kiln-bench-prepare-", dir=args.tmp))
    try:
        corpus = work / "corpus"
        text_bytes = generate(corpus, args.size_mb)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        rows = []
        took, rss = run_measured([sys.executable, "-c", BASELINE, str(tok), str(corpus)], env)
        rows.append(("tokenizers encode_batch_fast (all cores, one process)", took, rss))
        for n in workers:
            out = work / f"out_{n}"
            cmd = [sys.executable, "-m", "kiln.recipes.cli", "data", "prepare", "--input",
                   str(corpus), "--out", str(out), "--tokenizer", str(tok), "--workers", str(n),
                   "--no-progress"]
            took, rss = run_measured(cmd, env)
            rows.append((f"kiln data prepare --workers {n}", took, rss))
            shutil.rmtree(out, ignore_errors=True)
        base = rows[0][1]
        print(f"CPU: {cpu_model()} ({cpus} cores); corpus {text_bytes / 1e6:,.0f} MB of text "
              f"in {len(list(corpus.glob('*.jsonl')))} JSONL files; tokenizer {tok}")
        print(f"{'':58} {'MB/s':>7} {'time vs bare':>13} {'peak RSS (tree)':>16}")
        for name, took, rss in rows:
            print(f"{name:58} {text_bytes / took / 1e6:7.2f} {took / base:12.2f}x "
                  f"{rss / 2**20:12,.0f} MiB")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

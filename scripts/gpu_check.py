"""The GPU check: kiln's throughput on two recipes in three numerics setups, beside a peer.

Rows (``ROWS``; add one to extend the check): the ~1B dense recipe (``gpu_1b.toml``) and the Nova
family at ~1.2B (``gpu_nova.toml``), each in bf16 eager, bf16 + compile and fp8 rowwise +
compile, the dense one with tensor parallel 2 where two GPUs are visible, fp8 on a micro-batch
of 1000 tokens (not a multiple of 16: the padded weight gradient), and the dense recipe with
MoE feed-forwards (torch._grouped_mm's backward on uneven expert groups). Each row is one
``kiln bench --json`` process (compile caches and CUDA memory do not leak between rows); a row
with a ``peer`` also runs ``scripts/reference_train.py`` (a plain PyTorch loop of the same model
and numerics) and reports kiln / peer tokens/s. A matmul probe
(8192^3 bf16 on CUDA) gives a measured ceiling beside the datasheet peak for MFU.

Results go to ``OUT`` (``--out``, default ``$OUT`` or ``runs/gpu_check``): ``gpu_check.json``
and ``gpu_check.md`` (the table). Rows that would start past ``--budget`` seconds are listed as
skipped, so the whole check fits the lent machine's time. ``--tiny`` shrinks every recipe for a
CPU dry run of the same code path (``scripts/gpu_check.sh --cpu``; a slow test runs it).

    python scripts/gpu_check.py [--steps 10] [--warmup 3] [--only dense] [--budget 420] [--tiny]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
H200_BF16_DENSE = 989e12  # datasheet, dense (kiln.recipes.probes.flops.GPU_PEAKS)


@dataclass
class Row:
    """One line of the table: a recipe, kiln overrides, and the peer's flags (None: no peer)."""

    shape: str
    setup: str
    recipe: str
    overrides: list[str]
    peer: list[str] | None = None
    ngpu: int = 1
    result: dict = field(default_factory=dict)


SETUPS = [  # (name, kiln overrides, reference_train.py flags)
    ("bf16 eager", ["--parallelism.compile=false", "--parallelism.float8=off"], []),
    ("bf16 + compile", ["--parallelism.compile=true", "--parallelism.float8=off"], ["--compile"]),
    ("fp8 rowwise + compile", ["--parallelism.compile=true", "--parallelism.float8=rowwise"],
     ["--compile", "--float8", "rowwise"]),
]
SHAPES = [  # (name, recipe, has a peer)
    ("dense ~1B", "train_configs/gpu_1b.toml", True),
    ("Nova ~1.2B", "train_configs/gpu_nova.toml", False),
]
# Setup-major order: if the time budget runs out, the last setup loses rows, not a whole shape.
ROWS = [Row(shape, setup, recipe, list(kiln), list(peer) if has_peer else None)
        for setup, kiln, peer in SETUPS for shape, recipe, has_peer in SHAPES]
# Tensor parallel over 2 GPUs (sequence parallel, loss parallel); skipped with fewer devices.
ROWS.append(Row("dense ~1B", "bf16 + compile, tp 2", "train_configs/gpu_1b.toml",
                ["--parallelism.compile=true", "--parallelism.float8=off", "--parallelism.tp=2"],
                None, ngpu=2))
# fp8 with a micro-batch of 1000 tokens, not a multiple of 16: the weight gradient's inner
# dimension, which a GPU's torch._scaled_mm refuses unpadded (parallelism.float8_pad_inner_dim;
# the CPU dry run's TINY shape is aligned, so the padding is switched on by name). Last: the
# throughput rows above keep the time budget.
ROWS.append(Row("dense ~1B", "fp8 rowwise, 1 x 1000 tokens (padded)", "train_configs/gpu_1b.toml",
                ["--parallelism.compile=false", "--parallelism.float8=rowwise",
                 "--parallelism.float8_pad_inner_dim=on", "--training.micro_batch=1",
                 "--training.seq_len=1000"]))
# MoE: torch._grouped_mm's backward on the GPU, token groups as the router makes them (uneven,
# not padded to any multiple), in the same numerics as the first setup.
ROWS.append(Row("dense ~1B as MoE (8 experts, top 2)", "bf16, grouped experts",
                "train_configs/gpu_1b.toml",
                ["--parallelism.compile=false", "--parallelism.float8=off", "--model.ffn.type=moe",
                 "--model.ffn.n_experts=8", "--model.ffn.top_k=2",
                 "--model.ffn.hidden_dim=1024"]))  # 8 x 1024: the dense 8192's parameters
# A CPU dry run: the same rows on a model of a few hundred thousand parameters.
TINY = ["--model.dim=64", "--model.n_layers=2", "--model.attention.n_heads=4",
        "--model.attention.n_kv_heads=2", "--model.ffn.hidden_dim=128", "--model.vocab_size=512",
        "--training.seq_len=64", "--training.micro_batch=2", "--training.global_batch=2",
        "--parallelism.float8_min_dim=16", "--training.mixed_precision=bf16"]


# The dry run checks that each row runs, not torchao's compiled 8-bit update (tested on its own,
# tests/components/optimizers/test_adamw8bit.py): on a 2-core CPU, compiling it was half of the
# Nova row's time.
TINY_RECIPE = {"train_configs/gpu_nova.toml": ["--optimizers.adamw.compile=false"]}


def kiln_command(row: Row, args, extra: list[str]) -> list[str]:
    tiny = TINY_RECIPE.get(row.recipe, []) if args.tiny else []
    bench = ["-m", "kiln.recipes.cli", "bench", row.recipe, "--steps", str(args.steps),
             "--warmup", str(args.warmup), "--json", *row.overrides, *tiny, *extra]
    if row.ngpu > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                f"--nproc-per-node={row.ngpu}", *bench]
    return [sys.executable, *bench]


def peer_command(row: Row, args, extra: list[str]) -> list[str]:
    """reference_train.py with the model shape that kiln resolves from the recipe."""
    from kiln.recipes.config.files import load_recipe

    recipe = load_recipe(REPO / row.recipe, extra)
    m, tr = recipe.model, recipe.training
    vocab = m.vocab_size or recipe.tokenizer.build().vocab_size
    shape = {"dim": m.dim, "n-layers": m.n_layers, "n-heads": m.attention.n_heads,
             "n-kv-heads": m.attention.n_kv_heads or m.attention.n_heads,
             "ffn-hidden": m.ffn.hidden_dim, "vocab": vocab, "seq-len": tr.seq_len,
             "batch": tr.micro_batch, "steps": args.steps, "warmup": args.warmup}
    flags = [x for k, v in shape.items() for x in (f"--{k}", str(v))]
    return [sys.executable, str(REPO / "scripts" / "reference_train.py"), *flags, *row.peer,
            "--device", args.device or ("cuda" if _cuda() else "cpu")]


def run_json(cmd: list[str], timeout: float, log) -> tuple[dict | None, str]:
    """Run ``cmd``; its last stdout line that is a JSON object, or None and the error tail."""
    log.write(f"$ {' '.join(cmd)}\n")
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    log.write(proc.stdout[-4000:] + proc.stderr[-4000:] + "\n")
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line), ""
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
    return None, f"exit {proc.returncode}: {tail}"


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def matmul_probe(device: str) -> float:
    """Measured bf16 matmul FLOP/s: 8192^3 on CUDA (CUDA events, median of 10 after 3 warm-ups,
    random data); kiln's CPU probe elsewhere."""
    import torch

    if device != "cuda":
        from kiln.recipes.probes.flops import matmul_probe as cpu_probe

        return cpu_probe("bf16")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.mm(a, b)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n**3 / sorted(times)[len(times) // 2]


def cpu_float8(rows: list[Row]) -> None:
    """A CPU dry run where this torch has no row-wise scaled matmul on CPU (torch 2.11): the fp8
    rows run tensorwise, so the path is still exercised (GPUs have both)."""
    from kiln.parallelisms.float8 import cpu_rowwise_scaled_mm

    if cpu_rowwise_scaled_mm():
        return
    for row in rows:
        if any("rowwise" in o for o in row.overrides):
            row.overrides = [o.replace("rowwise", "tensorwise") for o in row.overrides]
            row.peer = [p.replace("rowwise", "tensorwise") for p in row.peer or []] \
                if row.peer is not None else None
            row.setup += " (tensorwise: no row-wise fp8 on this CPU)"


def _fmt(x: float | None, spec: str) -> str:
    return "" if x is None else format(x, spec)


def markdown(rows: list[Row], meta: dict) -> str:
    probe = meta["matmul_probe_flops"]
    head = ["shape", "setup", "kiln tokens/s", f"MFU vs {meta['peak_name']}",
            f"MFU vs probe ({probe / 1e12:.3g} TF/s)", "peak mem GiB", "first step s",
            "data wait / step", "peer tokens/s", "kiln / peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        k, p = r.result.get("kiln"), r.result.get("peer")
        status = r.result.get("status", "")
        if k is None:
            cells = [r.shape, r.setup, status or "failed"] + [""] * (len(head) - 3)
        else:
            ratio = k["tokens_per_second"] / p["tokens_per_second"] if p else None
            wait = k.get("data_wait_fraction")
            cells = [
                r.shape, r.setup, _fmt(k["tokens_per_second"], ",.0f"),
                _fmt(k["achieved_flops"] / meta["peak_flops"], ".1%") if meta["peak_flops"]
                else "n/a",
                _fmt(k["achieved_flops"] / probe, ".1%"),
                _fmt(k["peak_memory_bytes"] / 2**30, ".1f"),
                _fmt(k["time_to_first_step_s"], ".1f"),
                _fmt(wait, ".2%"),
                _fmt(p["tokens_per_second"], ",.0f") if p else (
                    r.result.get("peer_status", "failed") if r.peer else "-"),
                _fmt(ratio, ".2f") + "x" if ratio else "-",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=int(os.environ.get("STEPS", 10)))
    ap.add_argument("--warmup", type=int, default=int(os.environ.get("WARMUP", 3)))
    ap.add_argument("--budget", type=float, default=float(os.environ.get("BUDGET", 420)),
                    help="seconds: rows that would start later are skipped")
    ap.add_argument("--timeout", type=float, default=240, help="seconds per process at most")
    ap.add_argument("--only", default="", help="run rows whose 'shape setup' contains this")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run)")
    ap.add_argument("--device", default="", help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--no-peer", action="store_true", help="skip the reference loop")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(REPO / "runs" / "gpu_check"))
    args, extra = ap.parse_known_args(argv)  # the rest: --section.key=value for every row
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    extra = [*(TINY if args.tiny else []), f"--training.device={device}", *extra]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    probe = matmul_probe(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    peak = H200_BF16_DENSE if "H200" in name or "H100" in name else 0.0
    meta = {"date": datetime.date.today().isoformat(), "device": name, "torch": torch.__version__,
            "python": sys.version.split()[0], "matmul_probe_flops": probe, "peak_flops": peak,
            "peak_name": "989 TF/s bf16 dense (datasheet)" if peak else "datasheet (unknown)",
            "steps": args.steps, "warmup": args.warmup, "tiny": args.tiny}
    print(f"gpu_check: {name}, torch {torch.__version__}, bf16 matmul probe "
          f"{probe / 1e12:.1f} TFLOP/s", flush=True)
    rows = [r for r in ROWS if args.only.lower() in f"{r.shape} {r.setup}".lower()]
    if device == "cpu":
        cpu_float8(rows)
    with open(out / "gpu_check.log", "a") as log:
        for row in rows:
            left = args.budget - (time.perf_counter() - t0)
            if left < 20:
                row.result["status"] = "skipped (time budget)"
                print(f"== {row.shape} / {row.setup}: skipped, time budget spent", flush=True)
                continue
            if device == "cuda" and row.ngpu > torch.cuda.device_count():
                row.result["status"] = f"skipped (needs {row.ngpu} GPUs)"
                print(f"== {row.shape} / {row.setup}: skipped, needs {row.ngpu} GPUs", flush=True)
                continue
            print(f"== {row.shape} / {row.setup}", flush=True)
            row.result["kiln"], err = run_json(kiln_command(row, args, extra),
                                               min(args.timeout, left), log)
            if err:
                row.result["kiln_error"] = err
                print(f"   kiln FAILED: {err}", flush=True)
            left = args.budget - (time.perf_counter() - t0)
            if row.peer is not None and not args.no_peer and left < 20:
                row.result["peer_status"] = "skipped (time budget)"
                print("   peer skipped, time budget spent", flush=True)
            elif row.peer is not None and not args.no_peer:
                row.result["peer"], err = run_json(peer_command(row, args, extra),
                                                   min(args.timeout, left), log)
                if err:
                    row.result["peer_error"] = err
                    print(f"   peer FAILED: {err}", flush=True)
            k, p = row.result.get("kiln"), row.result.get("peer")
            print(f"   kiln {k['tokens_per_second']:,.0f} tokens/s" if k else "", end="")
            print(f", peer {p['tokens_per_second']:,.0f} tokens/s" if p else "", flush=True)
    table = markdown(rows, meta)
    meta["wall_s"] = time.perf_counter() - t0
    (out / "gpu_check.json").write_text(json.dumps(
        {"meta": meta, "rows": [{"shape": r.shape, "setup": r.setup, "recipe": r.recipe,
                                 "overrides": r.overrides, **r.result} for r in rows]}, indent=1))
    (out / "gpu_check.md").write_text(
        f"kiln GPU check, {meta['date']}: {name}, torch {meta['torch']}, {args.steps} measured "
        f"steps after {args.warmup} warm-up\n\n{table}\n")
    print()
    print(table)
    print(f"\nwritten: {out / 'gpu_check.json'}, {out / 'gpu_check.md'}")
    failed = [r for r in rows if "kiln_error" in r.result or "peer_error" in r.result]
    return 1 if failed or not rows else 0


if __name__ == "__main__":
    sys.exit(main())

"""kiln against torchtitan on the same model, side by side in one run: the ratio of tokens/s.

    python scripts/bench_vs_torchtitan.py --peer-python PEER_ENV/bin/python [--rounds 3]

Absolute tokens/s depend on the machine; the ratio, measured in one run with both sides
alternating (so drift in the machine's load hits both), is what carries over. Each round runs
``kiln bench train_configs/llama_debug.toml --json`` and then the peer, in fresh processes, in
fp32 and in bf16 autocast, and the table gives the median of each side and of the per-round
ratios, with the CPU model.

The peer is torchtitan 0.2.x (the TOML era; install it from PyPI into its own environment next
to torch 2.13: ``python -m venv --system-site-packages PEER_ENV && PEER_ENV/bin/pip install
torchtitan==0.2.2 triton``; torchtitan imports triton even on a CPU). torchtitan's trainer does
not run on a CPU (it falls back to the "cuda" device), and torchtitan 0.3.0 trains language
models only with flex or varlen attention, which have no CPU backward. So the peer is
torchtitan's own Llama 3 ``debugmodel`` (its model code, ``sdpa`` causal attention, its
``init_weights``), its AdamW built by ``build_optimizers`` (fused, lr 8e-4, betas 0.9/0.95,
weight decay 0.1), its cross-entropy and its gradient clipping, in the loop its trainer runs
(forward, loss, backward, clip, step), on random tokens of the same shape as kiln's batches:
seq 256, batch 4, vocabulary 2048, 6,163,712 parameters. kiln reads real data (its loader's
cost is included on kiln's side only).

``--peer`` runs one peer measurement in this process (the script calls itself that way).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = "train_configs/llama_debug.toml"
BATCH, SEQ, VOCAB = 4, 256, 2048  # llama_debug.toml = torchtitan's debugmodel at seq 256


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def process_age() -> float:
    """Seconds since this process started (0 where /proc is missing)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)


# --------------------------------------------------------------------------------- the peer
def peer(steps: int, warmup: int, bf16: bool, threads: int) -> dict:
    """torchtitan's debugmodel trained for warmup + steps steps; tokens/s over the last steps."""
    import contextlib
    from importlib import metadata
    from types import SimpleNamespace

    import torch

    try:
        from torchtitan.components.loss import cross_entropy_loss
        from torchtitan.components.optimizer import build_optimizers
        from torchtitan.config.job_config import Optimizer
        from torchtitan.distributed.utils import clip_grad_norm_
        from torchtitan.models.llama3 import Transformer, llama3_args
    except ImportError as exc:
        sys.exit(f"the peer needs torchtitan 0.2.x and triton in {sys.executable} ({exc}); "
                 "see this script's docstring")
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    args = llama3_args["debugmodel"]  # dim 256, 6 layers, 16 heads, vocab 2048, sdpa causal
    model = Transformer(args)
    with torch.no_grad():  # as torchtitan's trainer does
        model.init_weights()
    model.train()
    # build_optimizers reads only these two flags of the parallel layout
    optimizers = build_optimizers([model], Optimizer(), SimpleNamespace(ep_enabled=False,
                                                                         pp_enabled=False))
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if bf16
                else contextlib.nullcontext())
    gen = torch.Generator().manual_seed(0)
    ends = []
    start = time.perf_counter()
    for _ in range(warmup + steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        with autocast:
            pred = model(tokens[:, :-1])
        loss = cross_entropy_loss(pred, tokens[:, 1:])
        loss.backward()
        clip_grad_norm_(list(model.parameters()), max_norm=1.0, foreach=True)
        optimizers.step()
        optimizers.zero_grad()
        ends.append(time.perf_counter())
    step_time = (ends[-1] - (ends[warmup - 1] if warmup else start)) / steps
    return {
        "tokens_per_second": BATCH * SEQ / step_time,
        "step_time_s": step_time,
        # process start to the end of step 1 (interpreter, imports, model, first step)
        "time_to_first_step_s": process_age() - (time.perf_counter() - ends[0]),
        "params": sum(p.numel() for p in model.parameters()),
        "final_loss": float(loss),
        "version": metadata.version("torchtitan"),
    }


# ------------------------------------------------------------------------------ both sides
def run_json(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def kiln_cmd(steps: int, warmup: int, bf16: bool, threads: int) -> list[str]:
    cmd = [sys.executable, "-m", "kiln.recipes.cli", "bench", RECIPE, "--steps", str(steps),
           "--warmup", str(warmup), "--json", f"--training.threads={threads}"]
    return [*cmd, "--training.mixed_precision=bf16"] if bf16 else cmd


def peer_cmd(python: str, steps: int, warmup: int, bf16: bool, threads: int) -> list[str]:
    cmd = [python, str(Path(__file__).resolve()), "--peer", "--steps", str(steps), "--warmup",
           str(warmup), "--threads", str(threads)]
    return [*cmd, "--bf16"] if bf16 else cmd


def compare(args) -> dict:
    subprocess.run([sys.executable, "-m", "kiln.recipes.cli", "data", "prepare", RECIPE],
                   cwd=REPO, check=True, capture_output=True)  # the data cache is ready for both
    rows = {}
    for bf16 in {"fp32": [False], "bf16": [True], "both": [False, True]}[args.dtype]:
        kiln, titan, ratios = [], [], []
        for r in range(args.rounds):
            sides = [("kiln", kiln_cmd(args.steps, args.warmup, bf16, args.threads)),
                     ("peer", peer_cmd(args.peer_python, args.steps, args.warmup, bf16,
                                       args.threads))]
            if r % 2:
                sides.reverse()  # alternate who goes first
            got = {name: run_json(cmd) for name, cmd in sides}
            kiln.append(got["kiln"])
            titan.append(got["peer"])
            ratios.append(got["kiln"]["tokens_per_second"] / got["peer"]["tokens_per_second"])
            print(f"round {r + 1} {'bf16' if bf16 else 'fp32'}: kiln "
                  f"{got['kiln']['tokens_per_second']:,.0f} tok/s, torchtitan "
                  f"{got['peer']['tokens_per_second']:,.0f} tok/s", file=sys.stderr)
        rows["bf16" if bf16 else "fp32"] = {
            "kiln_tokens_per_second": statistics.median(k["tokens_per_second"] for k in kiln),
            "torchtitan_tokens_per_second": statistics.median(
                t["tokens_per_second"] for t in titan),
            "ratio": statistics.median(ratios),
            "kiln_time_to_first_step_s": statistics.median(
                k["time_to_first_step_s"] for k in kiln),
            "torchtitan_time_to_first_step_s": statistics.median(
                t["time_to_first_step_s"] for t in titan),
            "params": [kiln[0]["params"], titan[0]["params"]],
        }
    import torch

    return {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__,
            "torchtitan": titan[0]["version"], "rounds": args.rounds, "steps": args.steps,
            "rows": rows}


def render(result: dict) -> str:
    lines = [f"CPU: {result['cpu']}, {result['threads']} threads, torch {result['torch']}, "
             f"torchtitan {result['torchtitan']} (model code; see the script), "
             f"{result['rounds']} rounds x {result['steps']} steps, medians",
             "dtype  kiln tok/s  torchtitan tok/s  kiln / torchtitan  first step kiln / tt"]
    for dtype, r in result["rows"].items():
        lines.append(f"{dtype:5}  {r['kiln_tokens_per_second']:10,.0f}  "
                     f"{r['torchtitan_tokens_per_second']:16,.0f}  {r['ratio']:16.2f}x  "
                     f"{r['kiln_time_to_first_step_s']:6.1f} s / "
                     f"{r['torchtitan_time_to_first_step_s']:.1f} s")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-python", default=os.environ.get("KILN_PEER_PYTHON",
                                                                sys.executable),
                        help="python of the environment with torchtitan 0.2.x installed")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per dtype")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    parser.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 8),
                        help="intra-op threads on both sides")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "both"), default="both")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer:
        print(json.dumps(peer(args.steps, args.warmup, args.bf16, args.threads)))
        return 0
    result = compare(args)
    print(json.dumps(result) if args.json else render(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

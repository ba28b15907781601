"""A group's shared prompt in the generation cache (``CacheSession.share``) against every row
holding its own copy (``CacheSession.select``), on the same model and tokens: per prompt length
and group size, the milliseconds per decode step (median of --repeats, the two alternating),
the cache's bytes (every cache tensor) and the largest logit difference. The model is
``train_configs/llama_debug.toml``'s shape (dim 256, 6 layers, 16 heads of 16), seeded random
weights; the prompts are random ids; a decode step feeds one given token per row, as sampling
would. docs/benchmarks.md ("Reinforcement learning") quotes its output; ``--device cuda``
measures the matrix-product form a GPU runs (unmeasured so far).

    python scripts/shared_prompt.py [--prompts 4 --groups 4,8 --lengths 32,128,512 --steps 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_rows.common import cpu_model  # noqa: E402

from kiln.components.attention import kv_cache  # noqa: E402
from kiln.recipes.config.files import load_recipe  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "train_configs" / "llama_debug.toml"


def build(overrides: list[str], seq: int, device: str):
    recipe = load_recipe(RECIPE, [*overrides, f"--training.seq_len={seq}"])
    torch.manual_seed(0)
    return recipe.model.build(vocab_size=2048, seq_len=seq).to(device).eval()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def decode(model, prompts: torch.Tensor, group: int, steps: int,
           share: bool) -> tuple[torch.Tensor, float, int]:
    """(the decode steps' logits, seconds per step, cache bytes) for ``prompts`` (P, L), each
    given ``group`` rows."""
    n, length = prompts.shape
    device = prompts.device
    rows = torch.arange(n, device=device).repeat_interleave(group)
    new = torch.randint(0, 2048, (n * group, steps),
                        generator=torch.Generator().manual_seed(1)).to(device)
    saved = kv_cache.SHARE_MIN_PREFIX
    kv_cache.SHARE_MIN_PREFIX = 1 if share else 1 << 62  # this script compares both at any length
    try:
        with kv_cache.attach(model, n, length + steps, device) as session:
            session.begin(None, tokens=length)
            model(prompts)
            session.end()
            if not session.share(rows):
                if share:
                    raise SystemExit("this model's attention cannot share a prompt")
                session.select(rows)
            _sync(device)
            out, start = [], time.perf_counter()
            for i in range(steps):
                session.begin(None)
                out.append(model(new[:, i:i + 1]))
                session.end()
            _sync(device)
            seconds = (time.perf_counter() - start) / steps
            held = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()
                    for c in session.caches for part in (c.slots, c.prefixes)
                    for slot in part for x in slot}
    finally:
        kv_cache.SHARE_MIN_PREFIX = saved
    return torch.cat(out, 1), seconds, sum(held.values())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--groups", default="4,8", help="comma-separated group sizes")
    p.add_argument("--lengths", default="32,128,512", help="comma-separated prompt lengths")
    p.add_argument("--steps", type=int, default=64, help="decode steps")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2, help="intra-op threads (0: torch's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--override", action="append", default=[], help="a recipe override, "
                   "repeatable: --override=--model.n_layers=2")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    model = build(args.override, max(lengths) + args.steps, args.device)
    where = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else \
        f"{cpu_model()}, {torch.get_num_threads()} thread(s)"
    print(f"{where}, torch {torch.__version__}; "
          f"{args.prompts} prompts, {args.steps} decode steps, median of {args.repeats}")
    print("| prompt tokens | group | copied: ms per step | shared: ms per step | speed-up "
          "| copied: cache KiB | shared: cache KiB | largest logit difference |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for group in groups:
        for length in lengths:
            ids = torch.randint(0, 2048, (args.prompts, length),
                                generator=torch.Generator().manual_seed(length)).to(args.device)
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.repeats):
                results = {share: decode(model, ids, group, args.steps, share)
                           for share in (False, True)}
                for share, (_, seconds, _) in results.items():
                    times[share].append(seconds)
            copied, shared = (statistics.median(times[s]) for s in (False, True))
            diff = (results[True][0] - results[False][0]).abs().max().item()
            print(f"| {length} | {group} | {copied * 1e3:.2f} | {shared * 1e3:.2f} | "
                  f"{copied / shared:.2f}x | {results[False][2] / 1024:,.0f} | "
                  f"{results[True][2] / 1024:,.0f} | {diff:.1e} |")


if __name__ == "__main__":
    main()

"""Time the MoE expert kernels (``torch._grouped_mm`` vs the per-expert loop), forward and
forward+backward, for a few shapes and dtypes; prints one table.

    python scripts/bench_moe_dispatch.py [--device cpu|cuda] [--repeat 10] [--threads N]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.components.base import default_config  # noqa: E402

SHAPES = [  # (tokens, dim, experts, top_k, expert hidden)
    (2048, 256, 8, 2, 256),
    (4096, 512, 16, 2, 512),
    (4096, 512, 64, 6, 128),
]


def timed(fn, repeat: int, device: str) -> float:
    """Fastest of ``repeat`` runs in ms: the minimum is robust to other load on the machine."""
    fn()  # warm up (and the grouped_mm probe)
    best = float("inf")
    for _ in range(repeat):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"device {args.device}, threads {torch.get_num_threads()}, torch {torch.__version__}")
    print("tokens  dim  E  k  hidden  dtype     kernel   fwd ms  fwd+bwd ms  (fastest of repeats)")
    for n, d, e, k, h in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for kernel in ("grouped", "loop"):
                torch.manual_seed(0)
                cfg = default_config("ffn", "moe", n_experts=e, top_k=k, hidden_dim=h,
                                     dispatch=kernel)
                m = cfg.build(dim=d, layer_idx=0, n_layers=1).to(args.device, dtype).train()
                x = torch.randn(1, n, d, device=args.device, dtype=dtype, requires_grad=True)

                def fwd(m=m, x=x):
                    with torch.no_grad():
                        m(x)

                def fwd_bwd(m=m, x=x):
                    m(x).float().square().mean().backward()

                try:
                    f, fb = timed(fwd, args.repeat, args.device), timed(fwd_bwd, args.repeat,
                                                                        args.device)
                    row = f"{f:7.1f}  {fb:10.1f}"
                except RuntimeError as exc:
                    row = f"failed: {str(exc).splitlines()[0][:60]}"
                name = str(dtype).removeprefix("torch.")
                print(f"{n:6d} {d:4d} {e:2d} {k:2d} {h:7d}  {name:8s}  {kernel:7s}  {row}")


if __name__ == "__main__":
    main()

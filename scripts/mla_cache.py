"""Latent attention's generation cache: the latent (kv_rank + rope_head_dim per token and layer,
weights absorbed) against per-head keys and values (``model.attention.cache = "expanded"``) on
the same weights. Reports the cache's bytes per token, measured from the cache tensors, the
time per decoded token (median of --repeats, both modes alternating) and the largest logit
difference between the two. docs/models.md quotes its output.

    python scripts/mla_cache.py [--dim 256 --layers 4 --heads 8 --kv-rank 64 --tokens 256]
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

from kiln.components.attention.kv_cache import attach  # noqa: E402
from kiln.recipes.config.files import load_recipe  # noqa: E402

RECIPE = Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml"


def build(args, cache: str):
    recipe = load_recipe(RECIPE, [
        f"--model.dim={args.dim}", f"--model.n_layers={args.layers}",
        "--model.attention.type=latent", f"--model.attention.n_heads={args.heads}",
        f"--model.attention.kv_rank={args.kv_rank}", f"--model.attention.q_rank={args.q_rank}",
        f"--model.attention.nope_head_dim={args.nope}", "--model.attention.rope_head_dim=16",
        f"--model.attention.v_head_dim={args.nope}", f"--model.attention.cache={cache}",
        f"--training.seq_len={args.tokens}"])
    torch.manual_seed(0)
    return recipe.model.build(vocab_size=256, seq_len=args.tokens).eval()


@torch.no_grad()
def decode(model, ids: torch.Tensor, prompt: int) -> tuple[torch.Tensor, float, int]:
    """(logits of every decoded token, seconds per decoded token, cache bytes)."""
    b, t = ids.shape
    with attach(model, batch=b, max_len=t, device="cpu") as session:
        session.begin(None, tokens=prompt)
        out = [model(ids[:, :prompt])[:, -1:]]
        session.end()
        start = time.perf_counter()
        for i in range(prompt, t):
            session.begin(None)
            out.append(model(ids[:, i:i + 1]))
            session.end()
        seconds = (time.perf_counter() - start) / (t - prompt)
        size = sum(x.numel() * x.element_size() for c in session.caches for slot in c.slots
                   for x in slot)
    return torch.cat(out, dim=1), seconds, size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-rank", type=int, default=64)
    p.add_argument("--q-rank", type=int, default=96)
    p.add_argument("--nope", type=int, default=32, help="nope and value head width")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (0: torch's)")
    args = p.parse_args()
    if args.threads:  # 0: torch's default
        torch.set_num_threads(args.threads)
    models = {kind: build(args, kind) for kind in ("latent", "expanded")}
    models["expanded"].load_state_dict(models["latent"].state_dict())
    ids = torch.randint(0, 256, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {kind: [] for kind in models}
    for _ in range(args.repeats):
        results = {kind: decode(m, ids, prompt=16) for kind, m in models.items()}
        for kind, (_, seconds, _) in results.items():
            times[kind].append(seconds)
    diff = (results["latent"][0] - results["expanded"][0]).abs().max().item()
    print(f"{cpu_model()}, {args.threads} thread(s), torch {torch.__version__}; dim {args.dim}, "
          f"{args.layers} layers, {args.heads} heads, kv_rank {args.kv_rank}, "
          f"{args.tokens} tokens")
    print("| cache | bytes per token (all layers) | ms per decoded token |")
    print("|---|---|---|")
    for kind in models:
        per_token = results[kind][2] / args.tokens
        print(f"| {kind} | {per_token:,.0f} | {statistics.median(times[kind]) * 1e3:.2f} |")
    ratio = results["expanded"][2] / results["latent"][2]
    print(f"expanded / latent memory: {ratio:.1f}x; largest logit difference {diff:.1e}")


if __name__ == "__main__":
    main()

"""The peer of ``scripts/gpu_check.py``: a plain PyTorch training loop of the same dense model.

Llama 3 shape (RMSNorm, RoPE, GQA through SDPA, SwiGLU, untied head), fused AdamW, bf16
autocast, gradient clipping, optional per-block ``torch.compile`` and torchao float8 rowwise:
what a careful engineer writes in one file without kiln. It shares no code with kiln, so the
ratio kiln / reference in the check's table is the cost (or gain) of kiln's machinery on the
same shape. Input tokens are random (data loading costs well under 1% of a step either way).

    python scripts/reference_train.py --dim 2048 --n-layers 16 --n-heads 16 --n-kv-heads 8 \
        --ffn-hidden 8192 --vocab 512 --seq-len 2048 --batch 8 [--compile] [--float8 rowwise]

Prints one JSON line: tokens/s, step time, peak memory, time to first step.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv: int, hidden: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, t, self.n_heads, self.hd)
        k = self.wk(h).view(b, t, self.n_kv, self.hd)
        v = self.wv(h).view(b, t, self.n_kv, self.hd)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        x = x + self.wo(a.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent feature pairs of (B, T, H, D) by the (T, D/2) angle tables."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)  # (B, T, H, D/2) each
    c, s = cos[:, None], sin[:, None]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), -1).flatten(-2).to(x.dtype)


class Llama(nn.Module):
    def __init__(self, a: argparse.Namespace) -> None:
        super().__init__()
        self.embed = nn.Embedding(a.vocab, a.dim)
        self.blocks = nn.ModuleList(Block(a.dim, a.n_heads, a.n_kv_heads, a.ffn_hidden)
                                    for _ in range(a.n_layers))
        self.norm = nn.RMSNorm(a.dim, eps=1e-5)
        self.head = nn.Linear(a.dim, a.vocab, bias=False)
        hd = a.dim // a.n_heads
        freqs = 1.0 / 500000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        angles = torch.outer(torch.arange(a.seq_len, dtype=torch.float64), freqs)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.trunc_normal_(p, std=1.0 if "embed" in name else 0.02)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.cos, self.sin)
        return self.head(self.norm(x))


def main(argv: list[str] | None = None) -> dict:
    start = time.perf_counter()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in [("dim", 256), ("n-layers", 2), ("n-heads", 4), ("n-kv-heads", 0),
                          ("ffn-hidden", 512), ("vocab", 512), ("seq-len", 128), ("batch", 4),
                          ("steps", 10), ("warmup", 3)]:
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="torch.compile each block")
    ap.add_argument("--float8", default="off", help="torchao float8 recipe, e.g. rowwise")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    a = ap.parse_args(argv)
    a.n_kv_heads = a.n_kv_heads or a.n_heads
    dev = torch.device(a.device)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Llama(a)
    if a.float8 != "off":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(
            model, config=Float8LinearConfig.from_recipe_name(a.float8),
            module_filter_fn=lambda m, fqn: fqn != "head" and min(m.weight.shape) >= 64)
    if a.compile:
        for block in model.blocks:
            block.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=True)
    amp = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.dtype == "bf16")
    gen = torch.Generator(device=dev).manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ends = []
    for _ in range(a.warmup + a.steps):
        ids = torch.randint(0, a.vocab, (a.batch, a.seq_len + 1), device=dev, generator=gen)
        with amp:
            logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ends.append(time.perf_counter())
    step = (ends[-1] - ends[a.warmup - 1]) / a.steps if a.warmup else (ends[-1] - start) / a.steps
    peak = torch.cuda.max_memory_allocated() if dev.type == "cuda" else 0
    return {"tokens_per_second": a.batch * a.seq_len / step, "step_time_s": step,
            "peak_memory_bytes": peak, "time_to_first_step_s": ends[0] - start,
            "loss": loss.item(), "params": sum(p.numel() for p in model.parameters())}


if __name__ == "__main__":
    print(json.dumps(main()))

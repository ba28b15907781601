"""Per-step host overhead: kiln's trainer against a plain PyTorch loop around the very same model
(kiln's, built from the same recipe), on a model so small that the step is mostly Python: the
tiny shape of the CPU dry run in ``scripts/gpu_check.py`` (dim 64, 2 layers, 4 heads / 2 kv heads,
hidden 128, vocabulary 512, seq 64, batch 2), fp32.

The plain loop does what any loop that logs does: random tokens, forward, cross-entropy,
backward, ``clip_grad_norm_``, fused AdamW with a warmup-cosine ``LambdaLR``, ``zero_grad``, and
reads the loss and gradient norm on the host every step (kiln reads both in one transfer). kiln's
step time is ``kiln bench``'s with its data wait taken out (kiln reads real data; the loop makes
random tokens). The model being the same, the ratio is the cost of the trainer's machinery.
"""

from __future__ import annotations

import math
import time

from bench_rows.common import LLAMA_DEBUG, set_threads

TINY = ["--model.dim=64", "--model.n_layers=2", "--model.attention.n_heads=4",
        "--model.attention.n_kv_heads=2", "--model.ffn.hidden_dim=128", "--model.vocab_size=512",
        "--training.seq_len=64", "--training.micro_batch=2", "--training.global_batch=2"]


def kiln(p: dict) -> dict:
    from kiln.recipes.commands.bench import measure

    r = measure(LLAMA_DEBUG, [*TINY, f"--training.threads={p['threads']}"], p["steps"],
                p["warmup"])
    step = r["step_time_s"] - r["data_wait_s"]
    return {"step_ms": step * 1e3, "data_wait_ms": r["data_wait_s"] * 1e3, "params": r["params"]}


def peer(p: dict) -> dict:
    import torch
    import torch.nn.functional as F

    from kiln.recipes.config.files import load_recipe

    set_threads(p["threads"])
    recipe = load_recipe(LLAMA_DEBUG, TINY)
    tr, opt_cfg = recipe.training, recipe.optimizer
    torch.manual_seed(tr.seed)
    model = recipe.model.build(vocab_size=512, seq_len=tr.seq_len).train()
    opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=tuple(opt_cfg.betas),
                            weight_decay=opt_cfg.weight_decay, fused=True)
    total, warm = p["warmup"] + p["steps"], 2

    def lr_factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1 + math.cos(math.pi * min((step - warm) / max(total - warm, 1), 1.0)))

    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(0)
    ends = [time.perf_counter()]
    for _ in range(total):
        ids = torch.randint(0, 258, (tr.micro_batch, tr.seq_len + 1), generator=gen)
        logits = model(ids[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tr.grad_clip, foreach=True)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        loss.item(), norm.item()  # what the loop logs
        ends.append(time.perf_counter())
    step = (ends[-1] - ends[p["warmup"]]) / p["steps"]
    return {"step_ms": step * 1e3, "params": sum(x.numel() for x in model.parameters())}

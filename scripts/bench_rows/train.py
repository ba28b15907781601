"""Dense training step: kiln's trainer (``kiln bench``'s measurement) against torchtitan 0.2.2's
Llama 3 ``debugmodel`` in the loop its trainer runs; also the time to the first step.

torchtitan's trainer does not run on a CPU (it falls back to the "cuda" device), and torchtitan
0.3.0 trains language models only with flex or varlen attention, which have no CPU backward. So
the peer is torchtitan 0.2.x's own model code (``sdpa`` causal attention, its ``init_weights``),
its AdamW from ``build_optimizers`` (fused; lr 8e-4, betas 0.9/0.95, weight decay 0.1), its
cross-entropy and its gradient clipping, stepped in its trainer's order (forward, loss, backward,
clip, step) on random tokens of kiln's batch shape: seq 256, batch 4, vocabulary 2048, 6,163,712
parameters. With ``compile`` both sides compile what torchtitan's ``compile.enable`` compiles:
each block (torchtitan: ``fullgraph=True``) and the loss. kiln reads real data (its loader's
cost counts on kiln's side only).
"""

from __future__ import annotations

import contextlib
import time

from bench_rows.common import LLAMA_DEBUG, process_age, set_threads, torchtitan_missing

BATCH, SEQ, VOCAB = 4, 256, 2048  # llama_debug.toml = torchtitan's debugmodel at seq 256


def kiln(p: dict) -> dict:
    from kiln.recipes.commands.bench import measure

    overrides = [f"--training.threads={p['threads']}"]
    if p["bf16"]:
        overrides.append("--training.mixed_precision=bf16")
    if p["compile"]:
        overrides += ["--parallelism.compile=true", "--parallelism.compile_loss=true"]
    r = measure(LLAMA_DEBUG, overrides, p["steps"], p["warmup"])
    return {"tokens_per_second": r["tokens_per_second"], "step_time_s": r["step_time_s"],
            "time_to_first_step_s": r["time_to_first_step_s"], "params": r["params"]}


def peer(p: dict) -> dict:
    from importlib import metadata
    from types import SimpleNamespace

    import torch

    try:
        from torchtitan.components.loss import cross_entropy_loss
        from torchtitan.components.optimizer import build_optimizers
        from torchtitan.config.job_config import Compile, Optimizer
        from torchtitan.distributed.utils import clip_grad_norm_
        from torchtitan.models.llama3 import Transformer, llama3_args
        from torchtitan.models.llama3.infra.parallelize import apply_compile
    except ImportError as exc:
        raise torchtitan_missing(exc) from None
    set_threads(p["threads"])
    torch.manual_seed(0)
    model = Transformer(llama3_args["debugmodel"])  # dim 256, 6 layers, 16 heads, sdpa causal
    with torch.no_grad():  # as torchtitan's trainer does
        model.init_weights()
    model.train()
    loss_fn = cross_entropy_loss
    if p["compile"]:
        apply_compile(model, Compile(enable=True))
        loss_fn = torch.compile(loss_fn)
    # build_optimizers reads only these two flags of the parallel layout
    optimizers = build_optimizers([model], Optimizer(), SimpleNamespace(ep_enabled=False,
                                                                         pp_enabled=False))
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if p["bf16"]
                else contextlib.nullcontext())
    gen = torch.Generator().manual_seed(0)
    steps, warmup = p["steps"], p["warmup"]
    ends = []
    start = time.perf_counter()
    for _ in range(warmup + steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        with autocast:
            pred = model(tokens[:, :-1])
        loss = loss_fn(pred, tokens[:, 1:])
        loss.backward()
        clip_grad_norm_(list(model.parameters()), max_norm=1.0, foreach=True)
        optimizers.step()
        optimizers.zero_grad()
        ends.append(time.perf_counter())
    step_time = (ends[-1] - (ends[warmup - 1] if warmup else start)) / steps
    return {"tokens_per_second": BATCH * SEQ / step_time, "step_time_s": step_time,
            # process start to the end of step 1 (interpreter, imports, model, first step)
            "time_to_first_step_s": process_age() - (time.perf_counter() - ends[0]),
            "params": sum(x.numel() for x in model.parameters()),
            "version": f"torchtitan {metadata.version('torchtitan')}"}

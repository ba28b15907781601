"""GPT-2 at nanoGPT's CPU size (its README's CPU command on the Shakespeare-character config:
4 layers x 128 wide, 4 heads, block 64, batch 12, dropout 0, fp32), one thread by default.

- ``what = "model"``: kiln's GPT-2 (``train_configs/gpt2_char.toml`` at that size) against
  ``transformers``' ``GPT2LMHeadModel`` (SDPA attention) loaded from kiln's export of the same
  weights: one training step each in the same plain loop (forward, cross-entropy, backward,
  AdamW step, zero_grad) on the same random batches. Tokens per second: the blocks' speed.
- ``what = "loop"``: kiln's trainer on that recipe (``kiln bench``'s step time, the data wait
  taken out) against nanoGPT's training loop around the very same kiln model: random batches,
  the learning rate set each step, forward, loss, backward, ``clip_grad_norm_``, AdamW (fused
  off, as nanoGPT has it on CPU), ``zero_grad``, the loss read on the host each step. Tokens per
  second: what the trainer's machinery costs or saves.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from bench_rows.common import REPO, set_threads, timed_train_steps

RECIPE = str(REPO / "train_configs" / "gpt2_char.toml")
SIZE = ["--model.n_layers=4", "--model.dim=128", "--model.attention.n_heads=4",
        "--training.seq_len=64", "--model.max_seq_len=64", "--training.micro_batch=12",
        "--training.global_batch=12", "--model.dropout=0", "--model.attention.dropout=0"]
BATCH, SEQ, VOCAB = 12, 64, 258  # the byte tokenizer's ids (the model pads its table to 320)


def _model():
    import torch

    from kiln.components.models.block import padded_vocab
    from kiln.recipes.config.files import load_recipe

    recipe = load_recipe(RECIPE, SIZE)
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=padded_vocab(recipe.model, VOCAB), seq_len=SEQ)
    return recipe, model.train()


def _model_kiln(p: dict) -> dict:
    _, model = _model()
    seconds = timed_train_steps(model, list(model.parameters()), p, (BATCH, SEQ, VOCAB))
    return {"tokens_per_second": BATCH * SEQ / seconds, "step_ms": seconds * 1e3}


def _model_peer(p: dict) -> dict:
    import torch
    import transformers

    from kiln.checkpointing.huggingface import export

    _, model = _model()
    with tempfile.TemporaryDirectory() as tmp:
        export.export(model, None, Path(tmp) / "hf", model_table={}, recipe_file=None)
        hf = transformers.GPT2LMHeadModel.from_pretrained(
            Path(tmp) / "hf", dtype=torch.float32, attn_implementation="sdpa").train()
    seconds = timed_train_steps(lambda ids: hf(ids).logits, list(hf.parameters()), p,
                                (BATCH, SEQ, VOCAB))
    return {"tokens_per_second": BATCH * SEQ / seconds, "step_ms": seconds * 1e3}


def _loop_kiln(p: dict) -> dict:
    from kiln.recipes.commands.bench import measure

    r = measure(RECIPE, [*SIZE, f"--training.threads={p['threads']}"], p["steps"], p["warmup"])
    step = r["step_time_s"] - r["data_wait_s"]
    return {"tokens_per_second": BATCH * SEQ / step, "step_ms": step * 1e3}


def _loop_peer(p: dict) -> dict:
    import torch

    recipe, model = _model()
    opt_cfg, total = recipe.optimizer, p["warmup"] + p["steps"]
    warm = opt_cfg.schedule.warmup_steps

    def nanogpt_step(opt, it: int, params) -> None:  # nanoGPT's get_lr, set each iteration
        if it < warm:
            lr = opt_cfg.lr * (it + 1) / (warm + 1)
        else:
            ratio = min((it - warm) / max(total - warm, 1), 1.0)
            low = opt_cfg.lr * opt_cfg.schedule.min_lr_ratio
            lr = low + 0.5 * (1 + math.cos(math.pi * ratio)) * (opt_cfg.lr - low)
        for group in opt.param_groups:
            group["lr"] = lr
        torch.nn.utils.clip_grad_norm_(params, recipe.training.grad_clip)

    seconds = timed_train_steps(model, list(model.parameters()), p, (BATCH, SEQ, VOCAB),
                                nanogpt_step, foreach=False)  # nanoGPT's AdamW on a CPU
    return {"tokens_per_second": BATCH * SEQ / seconds, "step_ms": seconds * 1e3}


def kiln(p: dict) -> dict:
    set_threads(p["threads"])
    return _loop_kiln(p) if p["what"] == "loop" else _model_kiln(p)


def peer(p: dict) -> dict:
    set_threads(p["threads"])
    return _loop_peer(p) if p["what"] == "loop" else _model_peer(p)

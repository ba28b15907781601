"""Optimizer state of a LoRA step (rank 8 on q/k/v/o) against full fine-tuning of the same
model with the same AdamW (``lora.py``'s model and batch): bytes of every optimizer state
tensor after one step. A report, not a race: the adapters' saving is the ratio."""

from __future__ import annotations

from pathlib import Path

from bench_rows.common import set_threads
from bench_rows.generate import setup  # noqa: F401
from bench_rows.lora import kiln_model, timed_steps


def _state_mb(opt) -> float:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if hasattr(t, "numel")) / 2**20


def _side(p: dict, lora: bool) -> dict:
    set_threads(p["threads"])
    model = kiln_model(Path(p["work"]), lora=lora)
    params = [q for q in model.parameters() if q.requires_grad]
    _, opt = timed_steps(model, params, {**p, "warmup": 0, "steps": 1})
    return {"optimizer_mb": _state_mb(opt), "trainable": sum(q.numel() for q in params)}


def kiln(p: dict) -> dict:
    return _side(p, lora=True)


def peer(p: dict) -> dict:
    return _side(p, lora=False)

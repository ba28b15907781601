"""What scoring tasks needs, shared by the in-loop hook (``hooks/downstream.py``), ``kiln eval
--tasks`` and the harness model: the greedy decoder, the model's context, the task plans."""

from __future__ import annotations

import functools

from kiln.components.models.generation import Sampling, generate
from kiln.components.tasks.common import STDERR


def greedy_generate():
    """The greedy decoder a ``Scorer`` calls (``components/models/generation.py``)."""
    return functools.partial(generate, sampling=Sampling(temperature=0))


def model_context(model, fallback: int) -> int:
    """Tokens the model can attend over (its RoPE table), else ``fallback``."""
    return int(getattr(model, "max_seq_len", 0) or fallback)


def plan_tasks(tasks: dict, tokenizer, max_len: int, log) -> dict:
    """Each task's plan (read, encoded, batched); a truncation warning per task that cut."""
    plans = {}
    for name, task in tasks.items():
        plans[name] = plan = task.plan(tokenizer, max_len)
        if plan.truncated:
            log(f"kiln: WARNING: task {name!r}: {plan.truncated} of {plan.examples} examples cut "
                f"from the left to fit the model's context ({max_len} tokens)")
    return plans


def format_metrics(name: str, metrics: dict[str, float], examples: int, seconds: float) -> str:
    """``name: acc 0.6250 ± 0.1250  ...  (16 examples, 0.4 s)``: each metric with its
    standard error."""
    shown = "  ".join(f"{k} {v:.4f}" + (f" ± {metrics[k + STDERR]:.4f}"
                                        if k + STDERR in metrics else "")
                      for k, v in metrics.items() if not k.endswith(STDERR))
    return f"{name}: {shown}  ({examples} examples, {seconds:.1f} s)"

"""What scoring tasks needs, shared by the in-loop hook (``hooks/downstream.py``), ``kiln eval
--tasks``, the harness model and ``kiln validate``: the greedy decoder, the model's context, the
task plans."""

from __future__ import annotations

import functools
from collections.abc import Callable

from kiln.components.attention.kv_cache import supports_cache
from kiln.components.errors import RecipeError
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


def plan_evals(recipe, model, tokenizer, shape, *, distributed: bool,
               log: Callable[[str], None], read: bool = True) -> tuple[dict, dict, int]:
    """The ``[evals.*]`` tasks that run in the loop, read and planned as training plans them
    before step 1 (``recipes/hooks/downstream.py``): (tasks, plans, context length). Refuses
    what the loop cannot run: tasks under tensor or pipeline parallelism, a pause without
    snapshots, text generation on several processes without a KV cache. ``read=False``
    (``kiln validate --no-data``): the settings only, no task file opened."""
    cfgs = recipe.evals
    if not cfgs:
        return {}, {}, 0
    for size, name, key in ((shape.tp, "tensor", "tp"), (shape.pp, "pipeline", "pp")):
        if size > 1:  # (pipeline: each rank holds only its stages)
            raise RecipeError(f"[evals.*] tasks do not run under {name} parallelism yet "
                              f"(parallelism.{key} = {size}): evaluate the checkpoints with "
                              "`kiln eval RUN --tasks` instead")
    paused = [n for n, c in cfgs.items() if c.mode == "pause"]
    if paused and not recipe.checkpoint.enable:
        raise RecipeError(f"evals.{paused[0]}.mode = \"pause\" saves a snapshot: set "
                          "checkpoint.enable = true (or mode = \"inline\")")
    tasks = {n: c.build(name=n) for n, c in cfgs.items() if c.mode == "inline"}
    generating = [n for n, t in tasks.items() if hasattr(t, "generations")]
    if generating and distributed and not supports_cache(model):
        raise RecipeError(f"task {generating[0]!r} generates text on several processes, "
                          "which needs a model whose attention has a KV cache (prompts of "
                          "several lengths decode in step); this model has none: run it "
                          "offline with `kiln eval RUN --tasks`")
    max_len = model_context(model, recipe.training.seq_len)
    plans = plan_tasks(tasks, tokenizer, max_len, log) if read else {}
    return tasks, plans, max_len


def format_metrics(name: str, metrics: dict[str, float], examples: int, seconds: float) -> str:
    """``name: acc 0.6250 ± 0.1250  ...  (16 examples, 0.4 s)``: each metric with its
    standard error."""
    shown = "  ".join(f"{k} {v:.4f}" + (f" ± {metrics[k + STDERR]:.4f}"
                                        if k + STDERR in metrics else "")
                      for k, v in metrics.items() if not k.endswith(STDERR))
    return f"{name}: {shown}  ({examples} examples, {seconds:.1f} s)"

"""``kiln eval RUN --tasks NAME[,NAME]``: downstream task scores of a saved model (a run's
checkpoint, a chosen step, or a Hugging Face model folder), on one process. Tasks are the
``[evals.NAME]`` tables of the model's recipe, of a ``--task-file``, or of the command line
(``--evals.NAME.type=... --evals.NAME.path=...``); ``--pending`` runs what a paused training run
left in ``pending_downstream_eval.json``."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kiln.components import registry
from kiln.components.errors import RecipeError
from kiln.components.evals import presets, runner
from kiln.components.evals.scorer import Scorer
from kiln.recipes.downstream import PENDING, greedy_generate, model_context, plan_tasks
from kiln.recipes.runs import DOWNSTREAM_FILE
from kiln.recipes.schema import Recipe

RESULTS = DOWNSTREAM_FILE  # in the run folder: one line per `--pending` evaluation


def warn(text: str) -> None:
    """Notes go to stderr: stdout stays one JSON object under --json."""
    print(text, file=sys.stderr)


def task_file_tables(path: str, overrides: list[str]) -> dict:
    """The ``[evals.NAME]`` configs of a task file (``--evals.*`` overrides applied)."""
    from kiln.recipes.loader import load_layers
    from kiln.recipes.resolve import build_config

    layers = load_layers(path, [o for o in overrides if o.lstrip("-").startswith("evals.")])
    other = sorted(set(layers.data) - {"evals"})
    if other:
        raise RecipeError(f"{path}: a task file holds [evals.NAME] tables only; found "
                          f"{', '.join(other)}")
    return build_config(Recipe, {"evals": layers.data.get("evals", {})}, "", layers).evals


def recipe_evals(run: str, step: int, overrides: list[str]) -> tuple[dict, str]:
    """The ``[evals.NAME]`` configs of a run's (or checkpoint's) recipe, without loading the
    model; a Hugging Face folder has none."""
    from kiln.checkpointing import layout
    from kiln.checkpointing.resume import find_checkpoint
    from kiln.recipes.recipe import load_recipe

    path = Path(run)
    if (path / "config.json").is_file() and not (path / "recipe.toml").is_file():
        return {}, str(path)
    ckpt = find_checkpoint(path)
    if step:
        ckpt = ckpt.parent / layout.step_name(step)
    return load_recipe(ckpt, overrides).evals, str(ckpt)


def evaluate_model(model, tokenizer, recipe, configs: dict, *, device: torch.device,
                   log=warn, limit: int = 0) -> dict[str, dict[str, Any]]:
    """Every task of ``configs`` on ``model`` (moved to ``device``); per task its metrics,
    examples, truncated examples and seconds."""
    model = model.to(device).eval()
    autocast = (torch.autocast(device.type, dtype=torch.bfloat16)
                if recipe.training.mixed_precision == "bf16" else contextlib.nullcontext())
    tasks = {}
    for name, cfg in configs.items():
        if limit:
            cfg = cfg.model_copy(update={"limit": limit})
        tasks[name] = cfg.build(name=name)
    max_len = model_context(model, recipe.training.seq_len)
    plans = plan_tasks(tasks, tokenizer, max_len, log)
    scorer = Scorer(model, max_len=max_len, vocab_size=tokenizer.vocab_size, autocast=autocast,
                    generate=greedy_generate())
    out = {}
    with torch.no_grad():
        for name, task in tasks.items():
            started = time.perf_counter()
            metrics = runner.run(task, plans[name], scorer)
            out[name] = {"type": configs[name].type, "metrics": metrics,
                         "examples": plans[name].examples, "truncated": plans[name].truncated,
                         "seconds": round(time.perf_counter() - started, 3)}
    return out


def select(configs: dict, names: str, source: str) -> dict:
    if not configs:
        raise RecipeError(f"{source} defines no [evals.NAME] tasks: give --task-file FILE or "
                          "--evals.NAME.type=... --evals.NAME.path=... (docs/evaluation.md)")
    wanted = list(configs) if names == "all" else [n.strip() for n in names.split(",") if n]
    unknown = [n for n in wanted if n not in configs]
    if unknown:
        raise RecipeError(f"--tasks: unknown task {unknown[0]!r}"
                          f"{registry.did_you_mean(unknown[0], list(configs))}; tasks of "
                          f"{source}: {', '.join(configs)}")
    return {n: configs[n] for n in wanted}


def render(label: str, results: dict[str, dict[str, Any]]) -> str:
    lines = [f"model: {label}", f"{'task':<16} {'metric':<14} {'value':>8} {'examples':>9} "
             f"{'seconds':>8}"]
    for name, r in results.items():
        for i, (metric, value) in enumerate(r["metrics"].items()):
            head = (name, r["examples"], r["seconds"]) if i == 0 else ("", "", "")
            lines.append(f"{head[0]:<16} {metric:<14} {value:>8.4f} {head[1]:>9} {head[2]:>8}")
        if r["truncated"]:
            lines.append(f"{'':<16} ({r['truncated']} examples cut from the left to fit)")
    return "\n".join(lines)


def list_tasks(configs: dict, source: str) -> str:
    lines = ["task kinds ([evals.NAME] type = ...; plugins add kinds through entry points):"]
    lines += [f"  {e.name:<16} {e.doc}" for e in registry.entries("task")]
    lines.append("presets (preset = \"NAME\": the field map and prompt of a task's files):")
    lines += [f"  {n:<12} {p['type']:<16} {p['about']}" for n, p in presets.PRESETS.items()]
    if configs:
        lines.append(f"tasks of {source}:")
        for name, c in configs.items():
            when = f"every {c.interval} steps" if c.interval else "at the end" \
                if c.at_end else "offline only"
            lines.append(f"  {name:<16} {c.type:<16} {c.path}  ({c.num_fewshot}-shot, limit "
                         f"{c.limit or 'none'}, {when}, {c.mode})")
    return "\n".join(lines)


def run_pending(run: Path, *, device: torch.device, log=warn) -> list[dict[str, Any]]:
    """Evaluate every pending request of a paused run (oldest first); each result is appended
    to ``downstream_eval.jsonl`` and its request file removed."""
    from kiln.recipes.loader import Layered
    from kiln.recipes.resolve import build_config
    from kiln.recipes.saved_model import open_model

    files = sorted(run.glob("pending_downstream_eval*.json"),
                   key=lambda p: (p.name == PENDING, p.name))
    if not files:
        raise RecipeError(f"{run}: no {PENDING}: nothing is pending (a training run with "
                          "mode = \"pause\" tasks writes it)")
    done = []
    for file in files:
        try:
            request = json.loads(file.read_text(encoding="utf-8"))
            step, checkpoint, tables = request["step"], request["checkpoint"], request["tasks"]
        except (ValueError, KeyError, TypeError) as exc:
            raise RecipeError(f"{file}: not a pending-evaluation file ({exc}); delete it or "
                              "write step, checkpoint and tasks") from None
        configs = build_config(Recipe, {"evals": tables}, "", Layered()).evals
        # a path inside the run folder is written relative to it
        recipe, tokenizer, model, label = open_model(run / checkpoint)
        results = evaluate_model(model, tokenizer, recipe, configs, device=device, log=log)
        record = {"step": step, "checkpoint": checkpoint, "tasks": results}
        with (run / RESULTS).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        file.unlink()
        done.append({"label": label, **record})
    return done

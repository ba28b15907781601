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
from kiln.components.tasks import presets, runner
from kiln.components.tasks.common import STDERR
from kiln.components.tasks.scorer import Scorer
from kiln.recipes.config.schema import Recipe
from kiln.recipes.inference.pending import PENDING, RESULTS, scored, task_checksums
from kiln.recipes.inference.task_plans import greedy_generate, model_context, plan_tasks


def warn(text: str) -> None:
    """Notes go to stderr: stdout stays one JSON object under --json."""
    print(text, file=sys.stderr)


def task_file_tables(path: str, overrides: list[str]) -> dict:
    """The ``[evals.NAME]`` configs of a task file (``--evals.*`` overrides applied)."""
    from kiln.recipes.config.loader import load_layers
    from kiln.recipes.config.resolve import build_config

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
    from kiln.recipes.config.files import load_recipe
    from kiln.recipes.loading.checkpoint_model import is_hf_folder

    path = Path(run)
    if is_hf_folder(path):
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
    lines = [f"model: {label}", f"{'task':<16} {'metric':<14} {'value':>8} {'stderr':>8} "
             f"{'examples':>9} {'seconds':>8}"]
    for name, r in results.items():
        shown = [(m, v) for m, v in r["metrics"].items() if not m.endswith(STDERR)]
        for i, (metric, value) in enumerate(shown):
            head = (name, r["examples"], r["seconds"]) if i == 0 else ("", "", "")
            se = r["metrics"].get(metric + STDERR)
            se_text = f"{se:>8.4f}" if se is not None else f"{'-':>8}"
            lines.append(f"{head[0]:<16} {metric:<14} {value:>8.4f} {se_text} {head[1]:>9} "
                         f"{head[2]:>8}")
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
    from kiln.recipes.config.loader import Layered
    from kiln.recipes.config.resolve import build_config
    from kiln.recipes.loading.checkpoint_model import open_model

    if not run.is_dir():
        raise RecipeError(f"{run}: no such folder; give the run folder of a training run whose "
                          "tasks have mode = \"pause\"")
    files = sorted(run.glob("pending_downstream_eval*.json"),
                   key=lambda p: (p.name == PENDING, p.name))
    if not files:
        raise RecipeError(f"{run}: no {PENDING}: nothing is pending (a training run with "
                          "mode = \"pause\" tasks writes it)")
    done = []
    for file in files:
        step, checkpoint, tables, checksums = _read_request(file)
        done_before = scored(run, log)  # a run killed before removing a request it scored
        tables = {n: t for n, t in tables.items() if (step, n) not in done_before}
        if not tables:
            log(f"kiln: {file}: step {step} is scored already ({RESULTS}); request removed")
            file.unlink()
            continue
        try:
            configs = build_config(Recipe, {"evals": tables}, "", Layered()).evals
        except RecipeError as exc:
            raise RecipeError(f"{file}: {exc}") from None
        now = task_checksums(tables)
        for name, then in checksums.items():
            if name in now and now[name] != then:
                log(f"kiln: WARNING: {file}: task {name!r}: {tables[name]['path']} changed since "
                    f"step {step} paused (sha256 {then[:12]} then, {now[name][:12]} now); scored "
                    "with the file as it is now")
        # a path inside the run folder is written relative to it
        if not (run / checkpoint).exists():  # keep_last spares it: deleted by hand, or moved
            raise RecipeError(f"{file}: the snapshot of step {step}, {checkpoint}, is gone; "
                              f"restore it, or delete {file.name} to drop the request")
        recipe, tokenizer, model, label = open_model(run / checkpoint)
        results = evaluate_model(model, tokenizer, recipe, configs, device=device, log=log)
        record = {"step": step, "checkpoint": checkpoint, "tasks": results}
        with (run / RESULTS).open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        file.unlink()
        done.append({"label": label, **record})
    return done


def _read_request(file: Path) -> tuple[int, str, dict, dict]:
    """(step, checkpoint, task tables, task-file checksums) of a pending request, or one error
    naming the file and what is wrong."""
    fix = f"; delete it or write step, checkpoint and tasks ({PENDING} of a paused run)"
    try:
        request = json.loads(file.read_text(encoding="utf-8"))
        step, checkpoint, tables = request["step"], request["checkpoint"], request["tasks"]
    except (ValueError, KeyError, TypeError) as exc:
        raise RecipeError(f"{file}: not a pending-evaluation file ({exc}){fix}") from None
    for key, value, kind, ok in (
        ("step", step, "a number", isinstance(step, int) and not isinstance(step, bool)),
        ("checkpoint", checkpoint, "a path", isinstance(checkpoint, str) and checkpoint),
        ("tasks", tables, "a table", isinstance(tables, dict)
         and all(isinstance(t, dict) for t in tables.values())),
    ):
        if not ok:
            raise RecipeError(f"{file}: {key} is {value!r}, not {kind}{fix}")
    checksums = request.get("checksums") or {}  # requests of older versions have none
    return step, checkpoint, tables, checksums if isinstance(checksums, dict) else {}

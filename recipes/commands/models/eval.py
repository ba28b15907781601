"""`kiln eval RUN [--loops 1,2,4,8] [--tokens N] [--json] [--data.key=value ...]`: the held-out
loss of a run's newest checkpoint (or a given one). For a looped model, ``--loops`` evaluates
the same weights at each loop count H_eff <= H (early exit: the coda reads the state after
H_eff loops) and says whether deeper is better (loss non-increasing in H_eff).

Downstream tasks (docs/evaluation.md): ``--tasks NAME[,NAME]`` scores the ``[evals.NAME]`` tasks
(of the recipe, a ``--task-file`` or ``--evals.NAME.*`` overrides) on a run, a ``--step``, a
checkpoint or a Hugging Face model folder; ``--list-tasks``; ``--pending`` (a paused run's
requests); ``--harness TASKS`` hands the model to lm-evaluation-harness (``kiln harness``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kiln.components.devices import DEVICES
from kiln.components.errors import RecipeError
from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.recipes.hooks.evaluate import bits_per_byte
from kiln.recipes.runs import significance
from kiln.recipes.training.model_inputs import ModelInputs

TOLERANCE = 1e-3  # nats: smaller loss differences between loop counts are not called a gain


def add_arguments(parser) -> None:
    parser.add_argument("run", nargs="?", default="", help="run folder, its checkpoints folder, "
                        "a step_XXXXXXX folder, or (with --tasks / --harness) a Hugging Face "
                        "model folder")
    parser.add_argument("--loops", default="", help="comma-separated H_eff values, e.g. 1,2,4,8 "
                        "(looped models; default: the model's own H)")
    parser.add_argument("--tokens", type=int, default=0,
                        help="token budget per H_eff (0 = the recipe's eval.tokens)")
    parser.add_argument("--micro-batch", type=int, default=0,
                        help="sequences per forward (0 = the recipe's training.micro_batch)")
    parser.add_argument("--device", default="auto", choices=DEVICES,
                        help="auto: the accelerator present, else the CPU")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--tasks", default="", help="downstream tasks to score: names of "
                        "[evals.NAME] tables, comma-separated, or all")
    parser.add_argument("--task-file", default="", help="a TOML file of [evals.NAME] tables "
                        "(used instead of the recipe's; --evals.* overrides apply to it)")
    parser.add_argument("--list-tasks", action="store_true",
                        help="task kinds, presets and the tasks of RUN / --task-file")
    parser.add_argument("--step", type=int, default=0, help="this step's checkpoint of the run")
    parser.add_argument("--limit", type=int, default=0,
                        help="first N examples of every task (0 = each task's own limit)")
    parser.add_argument("--pending", action="store_true", help="evaluate the requests a "
                        "paused run wrote (pending_downstream_eval.json); results appended "
                        "to downstream_eval.jsonl in the run folder")
    parser.add_argument("--harness", default="", metavar="TASKS", help="run lm-evaluation-"
                        "harness tasks (names or task YAML files) on the model: short for "
                        "`kiln harness --model kiln --model_args path=RUN --tasks TASKS`")


def parse_loops(text: str, model: torch.nn.Module) -> list[int | None]:
    if not text:
        return [None]
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise RecipeError(
            f"--loops {text!r}: give comma-separated integers, e.g. 1,2,4,8") from None
    h = getattr(model, "loops", None)
    if h is None:
        raise RecipeError(f"--loops needs a looped model; this run's model is "
                          f"{type(model).__name__}, which has one depth (drop --loops)")
    bad = [v for v in values if not 1 <= v <= h]
    if bad:
        raise RecipeError(f"--loops {bad}: this model was trained with H = {h}; use values in "
                          f"1..{h}")
    return values


@torch.no_grad()
def eval_loss(model, loader, budget: int, loops: int | None, device, autocast,
              inputs=None) -> tuple[float, int]:
    """Mean next-token loss over the first ``budget`` tokens of the eval split; (loss, tokens).
    ``inputs``: the run's ``ModelInputs`` (a document-masked run evaluates with its mask)."""
    loss, count, _ = eval_loss_stderr(model, loader, budget, loops, device, autocast, inputs)
    return loss, count


@torch.no_grad()
def eval_loss_stderr(model, loader, budget: int, loops: int | None, device, autocast,
                     inputs=None) -> tuple[float, int, float]:
    """``eval_loss`` and its standard error over the batches (NaN for one batch)."""
    sums, counts = [], []  # per batch: summed token loss, trained tokens
    for batch in loader:
        if sum(counts) >= budget:
            break
        batch = {k: v.to(device) for k, v in batch.items()}
        ids, labels, extra = inputs(batch) if inputs is not None else (
            batch["input_ids"], batch["labels"], {})
        if loops is not None:
            extra["loops"] = loops
        with autocast:
            logits = model(ids, **extra)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        sums.append(float(loss))
        counts.append(int((labels != IGNORE_INDEX).sum()))  # masked (chat) data: trained tokens
    total, count = sum(sums), sum(counts)
    stderr = significance.ratio_stderr(np.array(sums), np.array(counts)) if sums else math.nan
    return (total / count if count else float("nan")), count, stderr


def evaluate_run(run: str, loops: str = "", tokens: int = 0, micro_batch: int = 0,
                 device: str = "auto", overrides: list[str] | None = None) -> dict:
    import contextlib

    from kiln.checkpointing.resume import find_checkpoint
    from kiln.components.devices import pick_device
    from kiln.recipes.config.files import load_recipe
    from kiln.recipes.loading.checkpoint_model import load_model

    ckpt = find_checkpoint(Path(run))
    recipe, tokenizer, model = load_model(ckpt)
    data_recipe = load_recipe(ckpt, overrides) if overrides else recipe
    dev = pick_device(device, key="--device")
    model = model.to(dev).eval()
    values = parse_loops(loops, model)
    tr = data_recipe.training
    mb = micro_batch or tr.micro_batch
    dataset = data_recipe.data.build(tokenizer=tokenizer, seq_len=tr.seq_len, seed=tr.seed)
    dataset.prepare()
    loader = dataset.loader("eval", micro_batch=mb, global_batch=mb, rank=0, world_size=1)
    autocast = (torch.autocast(dev.type, dtype=torch.bfloat16)
                if tr.mixed_precision == "bf16" else contextlib.nullcontext())
    budget = tokens or data_recipe.eval.tokens
    inputs = ModelInputs(getattr(recipe.model, "attention", None), dev)  # as trained
    inputs.check_model(model)
    rows = []
    for h in values:
        loss, n, se = eval_loss_stderr(model, loader, budget, h, dev, autocast, inputs)
        rows.append({"loops": h if h is not None else getattr(model, "loops", None),
                     "loss": loss, "stderr": se, "bpb": bits_per_byte(loss, dataset),
                     "tokens": n})
    return {"checkpoint": str(ckpt), "rows": rows, **verdict([r["loss"] for r in rows])}


def verdict(losses: list[float], tol: float = TOLERANCE) -> dict:
    """Deeper is better when no deeper H_eff is worse than the best shallower one by more than
    ``tol`` and the deepest beats the shallowest by more than ``tol`` (smaller differences are
    noise)."""
    if len(losses) < 2:
        return {"deeper_is_better": None, "gain": None}
    gain = losses[0] - losses[-1]
    monotone = all(losses[i] <= min(losses[:i]) + tol for i in range(1, len(losses)))
    return {"deeper_is_better": monotone and gain > tol, "gain": gain}


def render(result: dict) -> str:
    lines = [f"checkpoint: {result['checkpoint']}",
             "H_eff       loss   stderr      ppl      bpb   tokens"]
    for r in result["rows"]:
        h = "-" if r["loops"] is None else str(r["loops"])
        bpb = f"{r['bpb']:7.4f}" if r.get("bpb") is not None else "      -"
        se = f"{r['stderr']:7.5f}" if math.isfinite(r.get("stderr", math.nan)) else "      -"
        lines.append(f"{h:>5}  {r['loss']:9.5f}  {se}  {math.exp(min(r['loss'], 50)):7.2f}  "
                     f"{bpb}  {r['tokens']:>7,}")
    if result["deeper_is_better"] is not None:
        lines.append("deeper is better: " + _why(result["rows"], result["deeper_is_better"],
                                                 result["gain"]))
    return "\n".join(lines)


def _why(rows: list[dict], yes: bool, gain: float) -> str:
    """The verdict with its reason, in the terms of ``verdict``."""
    first, last = rows[0], rows[-1]
    span = f"H_eff {first['loops']} -> {last['loops']} changes the loss by {-gain:+.5f}"
    if yes:
        return f"yes ({span}; no deeper H_eff is worse than a shallower one by > {TOLERANCE:g})"
    if gain <= TOLERANCE:
        return f"no ({span}: not an improvement of more than {TOLERANCE:g})"
    for i in range(1, len(rows)):
        best = min(range(i), key=lambda j: rows[j]["loss"])
        if rows[i]["loss"] > rows[best]["loss"] + TOLERANCE:
            return (f"no: not monotone ({span}, but H_eff {rows[i]['loops']} is worse than "
                    f"H_eff {rows[best]['loops']} by {rows[i]['loss'] - rows[best]['loss']:.5f})")
    return f"no ({span})"


def run_tasks(args) -> int:
    """--tasks / --list-tasks / --pending / --harness."""
    from kiln.components.devices import pick_device
    from kiln.recipes.inference import task_eval

    device = lambda: pick_device(args.device, key="--device")  # noqa: E731 (not for --list-tasks)
    if args.harness:
        from kiln.recipes.commands.models.harness import run_harness

        if not args.run:
            raise RecipeError("--harness needs RUN (a run, checkpoint or Hugging Face folder)")
        step = f",step={args.step}" if args.step else ""
        return run_harness(["--model", "kiln", "--model_args", f"path={args.run}{step}",
                            "--tasks", args.harness, "--device", device().type])
    if args.pending:
        if not args.run:
            raise RecipeError("--pending needs RUN (the paused run's folder)")
        done = task_eval.run_pending(Path(args.run), device=device())
        print(json.dumps(_json_safe(done)) if args.json else
              "\n".join(task_eval.render(d["label"], d["tasks"]) for d in done))
        return 0
    from kiln.recipes.loading.checkpoint_model import open_model

    task_overrides = [o for o in args.overrides if o.lstrip("-").startswith("evals.")]
    model_overrides = [o for o in args.overrides if o not in task_overrides or not args.task_file]
    configs, source = {}, ""
    if args.task_file:
        configs = task_eval.task_file_tables(args.task_file, task_overrides)
        source = args.task_file
    if args.list_tasks:
        if args.run and not args.task_file:
            configs, source = task_eval.recipe_evals(args.run, args.step, model_overrides)
        print(task_eval.list_tasks(configs, source))
        return 0
    if not args.run:
        raise RecipeError("--tasks needs RUN (a run, checkpoint or Hugging Face folder)")
    recipe, tokenizer, model, label = open_model(args.run, step=args.step,
                                                 overrides=model_overrides)
    if not args.task_file:
        configs, source = recipe.evals, label
    chosen = task_eval.select(configs, args.tasks, source)
    results = task_eval.evaluate_model(model, tokenizer, recipe, chosen,
                                       device=device(), limit=args.limit)
    print(json.dumps(_json_safe({"model": label, "tasks": results})) if args.json
          else task_eval.render(label, results))
    return 0


def run(args) -> int:
    if args.tasks or args.list_tasks or args.pending or args.harness:
        return run_tasks(args)
    if not args.run:
        raise RecipeError("give RUN (a run folder, its checkpoints folder or a step folder)")
    result = evaluate_run(args.run, args.loops, args.tokens, args.micro_batch, args.device,
                          args.overrides)
    print(json.dumps(_json_safe(result)) if args.json else render(result))
    return 0


def _json_safe(value):
    """``value`` with every NaN / infinite float as null (JSON has no NaN: an unknown standard
    error, of one batch or one example)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value

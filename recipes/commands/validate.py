"""`kiln validate RECIPE...`: run every check `kiln train` runs before its first step (the same
functions, ``recipes/preflight/checks.py``): the batch plan and budget for the world size, the
data (prepared as a first run would), the model and its adapter on the meta device, optimizers
and their routing, schedules, step and guards; without training."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

from kiln.components.errors import KilnError, RecipeError
from kiln.components.protocols import complete_model
from kiln.parallelisms.layout.check import model_problems, raise_problems
from kiln.parallelisms.pipeline.checks import pipeline_problems
from kiln.recipes.config.files import load_recipe
from kiln.recipes.inference.task_plans import plan_evals
from kiln.recipes.loading.meta_model import build_meta_model
from kiln.recipes.preflight import batch_plan, checks
from kiln.recipes.training.layout_report import layout_report
from kiln.recipes.training.model_inputs import ModelInputs
from kiln.recipes.training.optimizer_set import OptimizerSet

TAKES_OVERRIDES = True  # kiln --help of the command shows them (recipes/cli.py)
EPILOG = ("NGPU in the environment: the world size to plan for, as "
          "./run_train.sh runs it (--world-size wins).")


def add_arguments(parser) -> None:
    parser.add_argument("recipes", nargs="+", help="recipe files")
    parser.add_argument("--world-size", type=int, default=0, metavar="N",
                        help="plan for N processes (default: $NGPU, else 1): check the batch "
                        "plan and the [parallelism] layout, print the mesh and per-rank memory")
    parser.add_argument("--no-data", action="store_true",
                        help="leave the data out: do not prepare or read it (its checks run at "
                        "train start)")


def human_count(n: int) -> str:
    """3,476,224 -> "3.48M"; 7,902,000,000 -> "7.90B" (three significant digits)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale * 0.9995:  # 999,999 prints as 1.00M, not 1000K
            value = n / scale
            digits = 2 if value < 10 else 1 if value < 100 else 0
            return f"{value:.{digits}f}{unit}"
    return str(n)


def describe(recipe, world_size: int = 1, *, data: bool = True) -> str:
    """Run the checks ``kiln train`` runs before step 1, in its order (``recipes/preflight``):
    batch plan and layout, the data (prepared as training would; ``data=False`` leaves it out),
    the model on meta with its adapter, the optimizers, guards and step; then summarise: budget,
    parameter counts, FLOPs/token, optimizer routing, and for more than one process the mesh
    and per-rank memory."""
    shape, bp = checks.plan_layout(recipe, world_size)
    source = checks.check_init_from(recipe)
    tr = recipe.training
    tokenizer = recipe.tokenizer.build()
    lines = [batch_plan.describe_budget(tr, bp)]
    run_data = None
    if data:
        run_data = checks.open_data(recipe, tokenizer, bp, rank=0, ranks=shape.dp,
                                    prepare=lambda dataset: dataset.prepare())
        getattr(run_data.train_loader, "close", lambda: None)()
        if not tr.steps:
            lines.append(f"  {run_data.total_steps:,} steps of this data")
        lines += run_data.lines
    model = build_meta_model(recipe, tokenizer)
    complete_model(model)
    checks.check_model(recipe, model, tokenizer)
    if source is not None:  # its tensors against the model, from the files' headers
        source.check(model)
    if recipe.adapter is not None:
        lines.append(checks.add_adapter(recipe, model)[1])
    raise_problems(model_problems(model, shape.tp, shape.ep, shape.cp)
                   + pipeline_problems(recipe.parallelism, tr, model, bp.grad_accum,
                                       recipe.checkpoint, getattr(recipe.model, "attention",
                                                                  None)), shape.describe())
    inputs = ModelInputs(getattr(recipe.model, "attention", None), torch.device("meta"),
                         cp=SimpleNamespace(size=shape.cp))
    inputs.check_model(model)
    total = model.num_params()
    lines.append(f"parameters: {total:,} ({human_count(total)})")
    lines += [f"  {k}: {v:,}" for k, v in model.param_summary().items()]
    lines.append(f"non-embedding parameters: {model.num_params(exclude_embeddings=True):,}")
    lines.append(checks.trainable_line(model))
    step = checks.build_step(recipe)
    lines.append(f"training FLOPs/token: {checks.flops_per_token(model, step, tr.seq_len):.4g}")
    steps = run_data.total_steps if run_data else (tr.steps or 1)
    opts = OptimizerSet(model, recipe.optimizer_tables(), steps)
    lines.append("optimizers:\n" + opts.table())
    with tempfile.TemporaryDirectory() as tmp:
        for cfg in recipe.guards.values():
            cfg.build(run_dir=Path(tmp))
    checks.check_step_data(recipe, run_data.dataset if run_data else None, step, shape)
    tasks = plan_evals(recipe, model, tokenizer, shape, distributed=world_size > 1,
                       log=lines.append, read=data)[0]  # read and encoded as training does
    if tasks and data:
        lines.append(f"in-loop tasks: {', '.join(tasks)} (read and encoded)")
    if run_data is not None and run_data.dataset.pairs:
        lines.append(run_data.dataset.describe())
    if run_data is not None:
        weighted = checks.token_weighted(recipe, run_data.dataset, step, shape)
        if weighted and (line := run_data.dataset.describe()):
            lines.append(line)
    else:
        lines.append("data: not read here (its checks run when training starts)")
    if world_size > 1:
        lines.append(layout_report(recipe, lambda: build_meta_model(recipe), world_size,
                                   grad_accum=bp.grad_accum))
    return "\n".join(lines)


def run(args) -> int:
    world_size = args.world_size or int(os.environ.get("NGPU", "1") or 1)
    if world_size < 1:
        raise RecipeError(f"--world-size {world_size}: give a number of processes >= 1")
    status = 0
    for path in args.recipes:
        try:
            recipe = load_recipe(path, args.overrides)
            text = describe(recipe, world_size, data=not args.no_data)
        except KilnError as exc:
            print(f"{path}: INVALID\n  {exc}")
            status = max(status, exc.exit_code)
            continue
        print(f"{path}: ok\n  " + text.replace("\n", "\n  "))
    return status

"""`kiln validate RECIPE...`: resolve each recipe and build its components on the meta device
(model, optimizers and their routing, schedules, step, guards) without training or data."""

from __future__ import annotations

import tempfile

import torch

from kiln.components.errors import KilnError
from kiln.recipes.optimizer_set import OptimizerSet
from kiln.recipes.recipe import load_recipe


def add_arguments(parser) -> None:
    parser.add_argument("recipes", nargs="+", help="recipe files")


def build_meta_model(recipe):
    tokenizer = recipe.tokenizer.build()
    with torch.device("meta"):
        return recipe.model.build(vocab_size=tokenizer.vocab_size, seq_len=recipe.training.seq_len)


def human_count(n: int) -> str:
    """3,476,224 -> "3.48M"; 7,902,000,000 -> "7.90B" (three significant digits)."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale * 0.9995:  # 999,999 prints as 1.00M, not 1000K
            value = n / scale
            digits = 2 if value < 10 else 1 if value < 100 else 0
            return f"{value:.{digits}f}{unit}"
    return str(n)


def describe(recipe) -> str:
    """Build on meta and summarise: parameter counts, FLOPs/token, optimizer routing."""
    model = build_meta_model(recipe)
    total = model.num_params()
    lines = [f"parameters: {total:,} ({human_count(total)})"]
    summary = getattr(model, "param_summary", None)
    if summary is not None:
        lines += [f"  {k}: {v:,}" for k, v in summary().items()]
    lines.append(f"non-embedding parameters: {model.num_params(exclude_embeddings=True):,}")
    lines.append(f"training FLOPs/token: {model.flops_per_token(recipe.training.seq_len):.4g}")
    steps = recipe.training.steps or 1
    opts = OptimizerSet(model, recipe.optimizer_tables(), steps)
    lines.append("optimizers:\n" + opts.table())
    recipe.training.step.build()
    with tempfile.TemporaryDirectory() as tmp:
        from pathlib import Path

        for cfg in recipe.guards.values():
            cfg.build(run_dir=Path(tmp))
    return "\n".join(lines)


def run(args) -> int:
    status = 0
    for path in args.recipes:
        try:
            recipe = load_recipe(path, args.overrides)
            text = describe(recipe)
        except KilnError as exc:
            print(f"{path}: INVALID\n  {exc}")
            status = max(status, exc.exit_code)
            continue
        print(f"{path}: ok\n  " + text.replace("\n", "\n  "))
    return status

"""`kiln validate RECIPE...`: resolve each recipe and build its components on the meta device
(model, optimizers and their routing, schedules, step, guards) without training or data."""

from __future__ import annotations

import tempfile

import torch

from kiln.components.errors import KilnError
from kiln.components.models.block import padded_vocab
from kiln.recipes.optimizer_set import OptimizerSet
from kiln.recipes.recipe import load_recipe


def add_arguments(parser) -> None:
    parser.add_argument("recipes", nargs="+", help="recipe files")


def build_meta_model(recipe):
    tokenizer = recipe.tokenizer.build()
    with torch.device("meta"):
        return recipe.model.build(vocab_size=padded_vocab(recipe.model, tokenizer.vocab_size),
                                  seq_len=recipe.training.seq_len)


def describe(recipe) -> str:
    """Build on meta and summarise: parameter counts, FLOPs/token, optimizer routing."""
    model = build_meta_model(recipe)
    total = model.num_params()
    lines = [f"parameters: {total:,} ({total / 1e9:.2f}B)"]
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

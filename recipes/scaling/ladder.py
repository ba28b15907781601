"""A scaling ladder: one recipe turned into several model sizes, each with its token budget.

The size rule (docs/scaling.md): a size is a width ``d`` (``model.dim``). Everything that scales
with width keeps the base recipe's proportions:

- depth: ``n_layers = max(1, round(d * n_layers_base / dim_base))`` (a fixed aspect ratio, as
  Kaplan et al. 2020 and OLMo-core's ladder sizes keep it); ``--depth fixed`` keeps the base
  depth (the width-only ladder that µP transfers across). A model without ``n_layers`` (the
  looped family's prelude / recurrent / coda) keeps its depth;
- heads: the base head width is kept, ``n_heads = d / head_dim`` (and ``n_kv_heads`` in the base
  ratio); a width that is not a multiple of the head width is refused;
- feed-forward: ``hidden_dim`` in the base ratio to ``dim``, rounded to a multiple of 8.

The budget: ``tokens_per_param`` sets each size's tokens as a multiple of its non-embedding
parameters (Hoffmann et al.'s ~20 is compute-optimal), or ``flops`` gives an iso-FLOP grid:
every size at every budget, steps = C / (FLOPs per token x tokens per step), FLOPs per token as
kiln's MFU counts them. Steps round up to whole optimizer steps; the base recipe's warmup keeps
its fraction of the run. Each size is a normal run folder under the ladder folder, trained by
``kiln sweep``'s loop (resumable: a finished size is skipped).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe
from kiln.recipes.runs.sweep import Point

DEPTHS = ("scaled", "fixed")
FFN_MULTIPLE = 8


def parse_numbers(text: str, what: str, kind=float) -> list:
    try:
        values = [kind(float(v)) if kind is int else kind(v) for v in text.split(",") if v]
    except ValueError:
        raise RecipeError(f"{what} {text!r}: a comma-separated list of numbers") from None
    if not values or any(v <= 0 for v in values) or len(set(values)) < len(values):
        raise RecipeError(f"{what} {text!r}: positive numbers, each once")
    return values


def size_values(base, width: int, depth: str) -> list[tuple[str, str]]:
    """The overrides that turn ``base`` (a resolved recipe) into the size of width ``width``."""
    model = base.model
    out = [("model.dim", str(width))]
    if depth == "scaled" and hasattr(model, "n_layers"):
        out.append(("model.n_layers", str(max(1, round(width * model.n_layers / model.dim)))))
    attn = getattr(model, "attention", None)
    if attn is not None and getattr(attn, "n_heads", 0):
        head_dim = getattr(attn, "head_dim", 0) or model.dim // attn.n_heads
        if width % head_dim:
            raise RecipeError(f"width {width}: not a multiple of the base recipe's head width "
                              f"{head_dim} (model.dim / model.attention.n_heads); pick widths "
                              f"that are")
        heads = width // head_dim
        out.append(("model.attention.n_heads", str(heads)))
        kv = getattr(attn, "n_kv_heads", 0)
        if kv:
            if (heads * kv) % attn.n_heads:
                raise RecipeError(f"width {width}: {heads} heads cannot keep the base ratio of "
                                  f"{attn.n_heads} heads to {kv} key/value heads")
            out.append(("model.attention.n_kv_heads", str(heads * kv // attn.n_heads)))
    ffn = getattr(model, "ffn", None)
    if ffn is not None and getattr(ffn, "hidden_dim", 0):
        hidden = max(FFN_MULTIPLE, round(ffn.hidden_dim * width / model.dim / FFN_MULTIPLE)
                     * FFN_MULTIPLE)
        out.append(("model.ffn.hidden_dim", str(hidden)))
    return out


def _steps_values(base, steps: int) -> list[tuple[str, str]]:
    out = [("training.steps", str(steps))]
    for name, opt in base.optimizer_tables().items():
        warmup = getattr(getattr(opt, "schedule", None), "warmup_steps", 0)
        if not warmup:
            continue
        key = "optimizer" if base.optimizer is not None else f"optimizers.{name}"
        total = base.training.steps or steps  # steps = 0: the budget came from tokens or epochs
        sized = max(1, min(round(warmup / total * steps), steps - 1 if steps > 1 else 1))
        out.append((f"{key}.schedule.warmup_steps", str(sized)))
    return out


def plan(recipe: str, overrides: list[str], widths: list[int], ladder_dir: Path, *,
         depth: str = "scaled", tokens_per_param: float = 20.0,
         flops: list[float] | None = None) -> list[Point]:
    """Every size's sweep point (its overrides and run folder), smallest first."""
    from kiln.recipes.loading.meta_model import build_meta_model

    if depth not in DEPTHS:
        raise RecipeError(f"--depth {depth!r}: one of {', '.join(DEPTHS)}")
    base = load_recipe(recipe, overrides)
    if base.checkpoint.init_from:  # one model of one width; every size would fail to load it
        raise RecipeError(
            f"checkpoint.init_from = {base.checkpoint.init_from!r}: a ladder trains every size "
            "from its own random start, and a pretrained model has one width; ladder the "
            "pretraining recipe, or add '--checkpoint.init_from=\"\"' to train these sizes "
            "from scratch")
    per_step = base.training.global_batch * base.training.seq_len
    points = []
    for width in sorted(widths):
        values = size_values(base, width, depth)
        sized = load_recipe(recipe, [*overrides, *(f"--{k}={v}" for k, v in values)])
        model = build_meta_model(sized)
        if flops:
            per_token = model.flops_per_token(sized.training.seq_len)
            for c in sorted(flops):
                steps = max(1, math.ceil(c / (per_token * per_step)))
                name = f"d{width}-C{c:.3g}".replace("+", "")
                points.append(_point(base, values, steps, ladder_dir / name))
        else:
            n = model.num_params(exclude_embeddings=True)
            steps = max(1, math.ceil(tokens_per_param * n / per_step))
            points.append(_point(base, values, steps, ladder_dir / f"d{width}"))
    return points


def _point(base, values, steps: int, folder: Path) -> Point:
    return Point(tuple(values + _steps_values(base, steps)), folder)


def write_plan(ladder_dir: Path, recipe: str, overrides: list[str], points: list[Point]) -> None:
    """``ladder.json`` (the base recipe, its overrides, each size's) and ``recipes/NAME.toml``
    (each size's resolved recipe: ``kiln show`` / ``kiln diff`` read them)."""
    from kiln.recipes.config.files import write_recipe, write_text_atomic

    (ladder_dir / "recipes").mkdir(parents=True, exist_ok=True)
    for p in points:
        write_recipe(load_recipe(recipe, [*overrides, *p.overrides]),
                     ladder_dir / "recipes" / f"{p.folder.name}.toml")
    write_text_atomic(ladder_dir / "ladder.json", json.dumps({
        "recipe": recipe, "overrides": overrides,
        "sizes": {p.folder.name: [f"--{k}={v}" for k, v in p.values] for p in points},
    }, indent=2) + "\n")

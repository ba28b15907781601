"""Everything ``kiln train`` refuses before its first step, in the functions ``kiln validate``
calls too: one code path, so ``validate`` says ``ok`` only for what ``train`` would start.

The trainer calls them in its start-up order (layout, data, model, adapter, token weighting);
``validate`` calls the same ones on a meta-device model and this process's share of the data.
What only a live run can check (the health check's collectives, a resumed checkpoint against
the recipe) stays with the trainer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.checkpointing.layout import newest_complete
from kiln.components.adapter_contract import AdapterContract
from kiln.components.errors import RecipeError
from kiln.components.protocols import complete_dataset, complete_step
from kiln.parallelisms.layout.check import raise_problems, training_problems
from kiln.parallelisms.layout.mesh import Layout, layout
from kiln.recipes.hooks.evaluate import eval_sources, split_loader
from kiln.recipes.loading.weights import Source, is_kiln_checkpoint
from kiln.recipes.preflight import batch_plan


def plan_layout(recipe, world_size: int) -> tuple[Layout, batch_plan.BatchPlan]:
    """The mesh of ``world_size`` processes and the batch plan over its data-parallel ranks;
    sequence lengths that tensor or context parallel ranks cannot split are refused."""
    shape = layout(recipe.parallelism, world_size)
    raise_problems(training_problems(recipe.training, shape.tp, shape.cp), shape.describe())
    return shape, batch_plan.plan(recipe.training, shape.dp, tp=shape.tp, cp=shape.cp)


def check_init_from(recipe) -> Source | None:
    """``checkpoint.init_from`` is there (a Hugging Face folder with its config.json, a kiln
    checkpoint or run folder with a finished checkpoint) before anything is built; the source,
    for ``Source.check`` once the model is (None: not read by this run). A run that will resume
    its own checkpoint does not read it, unless it trains adapters on it; a Hub path is fetched
    when training starts."""
    cfg = recipe.checkpoint
    if not cfg.init_from or cfg.init_from.startswith("hf://"):
        return None
    own = Path(recipe.run.folder) / "checkpoints"
    resumes = cfg.resume != "off" and (
        cfg.resume != "auto" or (own.is_dir() and newest_complete(own, warn=False) is not None))
    if recipe.adapter is None and resumes:
        return None
    return Source.open(recipe)


@dataclass
class RunData:
    """The dataset, this rank's train loader, the run's length and the lines for the log."""

    dataset: Any
    train_loader: Any
    total_steps: int
    lines: list[str] = field(default_factory=list)


def open_data(recipe, tokenizer, plan: batch_plan.BatchPlan, *, rank: int, ranks: int,
              prepare: Callable[[Any], None]) -> RunData:
    """Build and ``prepare`` the dataset, open data-parallel rank ``rank``'s train loader, fix
    the run's length, check the run against the data (a mixture's stages and epochs) and that
    every eval split holds one batch."""
    tr = recipe.training
    # a plugin dataset gets the contract's no-op members (protocols.DatasetContract)
    dataset = complete_dataset(recipe.data.build(tokenizer=tokenizer, seq_len=tr.seq_len,
                                                 seed=tr.seed))
    prepare(dataset)
    loader = dataset.loader("train", micro_batch=tr.micro_batch, global_batch=tr.global_batch,
                            rank=rank, world_size=ranks)
    total = batch_plan.total_steps(tr, plan, getattr(loader, "steps_per_epoch", None))
    data = RunData(dataset, loader, total)
    data.lines += dataset.check_run(total, plan.global_batch)  # e.g. a mixture's stages
    attention = getattr(recipe.model, "attention", None)
    if recipe.data.type == "chat" and getattr(recipe.data, "pack", False) \
            and attention is not None and not getattr(attention, "document_mask", False):
        data.lines.append(
            "chat data: note: data.pack = true puts several conversations in a row and, without "
            "model.attention.document_mask, each attends to those before it; set document_mask "
            "= true and positions = \"per_document\" (as sft_debug.toml does) to keep each to "
            "itself")
    if recipe.eval.at_end or 0 < recipe.eval.interval <= total:
        for source in eval_sources(dataset):  # each fits one batch, or fails now
            getattr(split_loader(dataset, plan.micro_batch, rank, ranks, source), "close",
                    lambda: None)()
    return data


def compute_dtype(recipe) -> torch.dtype:
    """The dtype matmuls run in: bf16 under autocast or FSDP2 bf16 params, else fp32."""
    bf16 = recipe.training.mixed_precision == "bf16" or (
        recipe.parallelism.param_dtype == "bfloat16")
    return torch.bfloat16 if bf16 else torch.float32


def position_limit(model: nn.Module) -> int | None:
    """The most positions the model's RoPE tables and learned position rows cover (None: the
    model has neither, e.g. NoPE, and takes any length)."""
    from kiln.components.models.absolute_positions import AbsolutePositions
    from kiln.components.positions.rope import RoPE

    sizes = [m.max_seq_len for m in model.modules() if isinstance(m, RoPE)]
    sizes += [m.weight.shape[0] for m in model.modules() if isinstance(m, AbsolutePositions)]
    return min(sizes) if sizes else None


def check_model(recipe, model: nn.Module, tokenizer) -> None:
    """The model (completed: ``complete_model``) holds the tokenizer's vocabulary and, for the
    chunked loss, takes ``head=``; its kernels (``resolve_kernels``, e.g. MoE's ``dispatch =
    "grouped"``) take its shapes; its position tables cover ``training.seq_len``."""
    model.resolve_kernels(torch.device("meta"), compute_dtype(recipe),  # checks, probes none
                          compiling=recipe.parallelism.compile)
    seq_len, known = recipe.training.seq_len, position_limit(model)
    if known is not None and seq_len > known:  # was a ValueError from the first forward
        raise RecipeError(
            f"training.seq_len = {seq_len} exceeds the {known} positions the model knows "
            f"(model.max_seq_len = {recipe.model.max_seq_len}: its RoPE table or learned "
            "positions); raise model.max_seq_len or set it to 0 (= training.seq_len)")
    if getattr(model, "vocab_size", tokenizer.vocab_size) < tokenizer.vocab_size:
        raise RecipeError(
            f"model.vocab_size = {model.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size}); raise it or set 0 to use the "
            "tokenizer's (rounded up to model.vocab_multiple)")
    chunk = recipe.training.loss_chunk_tokens
    if chunk and "head" not in inspect.signature(model.forward).parameters:
        raise RecipeError(
            f"training.loss_chunk_tokens = {chunk} needs a model whose forward takes head= "
            f"(docs/design.md); {type(model).__name__} does not: set "
            "training.loss_chunk_tokens = 0")


def add_adapter(recipe, model: nn.Module) -> tuple[AdapterContract, str]:
    """``[adapter]``: check it can run with this recipe, freeze ``model`` and add the adapters
    (before parallelize, so FSDP2 shards them with their blocks); (the adapter, a line for the
    log)."""
    p, adapter = recipe.parallelism, recipe.adapter
    why = ("parallelism.tp > 1" if p.tp > 1 else "parallelism.pp > 1" if p.pp > 1
           else f"parallelism.float8 = {p.float8!r}" if p.float8 != "off" else "")
    if why:
        raise RecipeError(f"[adapter] {adapter.type}: not with {why} yet (the adapters hook "
                          "plain nn.Linear layers on whole weights); turn it off or fine-tune "
                          "all weights without [adapter]")
    if recipe.checkpoint.export_at_end:
        raise RecipeError("checkpoint.export_at_end with [adapter]: export the run's last "
                          "checkpoint instead (`kiln export CHECKPOINT OUT_DIR` merges the "
                          "adapters, --format peft writes them alone)")
    base = recipe.checkpoint.init_from
    on_hf = base and (base.startswith("hf://") or Path(base).expanduser().is_dir()) \
        and not is_kiln_checkpoint(base)
    if getattr(recipe.model, "mtp_depth", 0) and on_hf:
        raise RecipeError(
            f"model.mtp_depth = {recipe.model.mtp_depth} with [adapter] on a Hugging Face base "
            f"({base}): its checkpoint holds no multi-token prediction weights, so those modules "
            "would stay frozen at their random initialisation and their loss would train the "
            "adapters toward them; set model.mtp_depth = 0, or fine-tune all weights")
    built = adapter.build()
    built.check_base(base)
    return built, built.apply(model)


def build_step(recipe):
    """The step component, with the step contract's defaults a plugin step lacks."""
    return complete_step(recipe.training.step.build())


def trunk_only(model: nn.Module, step_fn) -> bool:
    """The model has multi-token prediction modules that the step leaves alone (it scores the
    main head: ``StepContract.trains_mtp`` false)."""
    return getattr(model, "mtp", None) is not None and not step_fn.trains_mtp


def flops_per_token(model: nn.Module, step_fn, seq_len: int) -> float:
    """The model's training FLOPs per token (MFU's): its multi-token prediction modules count
    only where the step runs them."""
    if trunk_only(model, step_fn):
        return float(model.flops_per_token(seq_len, mtp=False))
    return float(model.flops_per_token(seq_len))


def check_step_data(recipe, dataset, step_fn, shape: Layout) -> None:
    """The step takes the data's batches: preference pairs need a step that takes pairs, and
    such a step needs pairs; then the step's own checks (``StepContract.check_recipe``).
    ``dataset`` None: the data is not read here (``kiln validate --no-data``)."""
    takes = step_fn.takes_pairs
    pairs = None if dataset is None else (dataset.pairs or "")
    step, data = recipe.training.step.type, recipe.data.type
    if pairs is not None and pairs != (takes or "") and "prompts" in (pairs, takes):
        raise RecipeError(
            f"training.step.type = {step!r} samples completions of prompts, and data.type = "
            f"{data!r} holds none; use data.type = \"prompts\"" if takes == "prompts" else
            f"data.type = {data!r} holds prompts to sample from, which training.step.type = "
            f"{step!r} cannot train on; use training.step.type = \"grpo\"" + (
                f" (or data.type = \"preference\" for the {takes} rows it takes)" if takes
                else ""))
    if pairs is not None and pairs != (takes or ""):
        raise RecipeError(
            f"training.step.type = {step!r} trains on preference pairs, and data.type = "
            f"{data!r} has none; use data.type = \"preference\"" if not pairs else
            f"data.type = {data!r} holds preference pairs (chosen, then rejected rows), which "
            f"training.step.type = {step!r} would train on as plain text; use "
            "training.step.type = \"preference\"" if not takes else
            f"data.type = {data!r} holds {pairs} examples and training.step.loss.type = "
            f"{recipe.training.step.loss.type!r} takes {takes} ones (KTO takes unpaired "
            "rows with a label, the other losses chosen / rejected pairs)")
    step_fn.check_recipe(recipe, shape)
    if dataset is not None:
        step_fn.check_data(dataset)


def token_weighted(recipe, dataset, step_fn, shape: Layout) -> bool:
    """Masked data (``chat``) takes the mean over the global batch's trained tokens; only a
    step that weights its micro-batches can train it, and not where a rank sees a part of each
    row (context parallel) or the pipeline computes the loss."""
    if not dataset.token_weighted:
        return False
    why = ("parallelism.cp > 1" if shape.cp > 1
           else "pipeline parallelism" if shape.pp > 1
           else "" if step_fn.token_weighted
           else f"training.step.type = {recipe.training.step.type!r}")
    if why:
        raise RecipeError(
            f"{recipe.data.type} data masks its labels, so the loss is token-weighted over "
            f"the global batch, which {why} does not do yet; use the standard step without "
            "context or pipeline parallelism")
    return True


def trainable_line(model: nn.Module) -> str:
    """Trainable parameters of ``model`` against all (an adapter run trains a few)."""
    params = list(model.parameters())  # (each shared tensor once)
    total = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return f"trainable parameters: {trainable:,} of {total:,} ({trainable / total:.2%})"

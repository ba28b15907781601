"""The per-rank memory part of ``kiln validate RECIPE --world-size N`` (the layout planner).

The model is built on the meta device and parallelized for N fake ranks
(``kiln.recipes.preflight.layout_plan``); the report gives the mesh, and rank 0's parameter,
gradient and optimizer-state bytes. Optimizer state per element is measured, not assumed: each
optimizer of the recipe takes one step on a probe matrix in this process, and its state bytes
per element (moments, momentum, 8-bit codes and scales) scale rank 0's elements routed to it.
Activations of one micro-batch are measured on the meta device (``activation_memory``) at the
recipe's ``parallelism.cp`` and at the other context-parallel degrees the world size allows, to
pick cp for a long context; ``kiln bench`` measures a real run.
"""

from __future__ import annotations

import torch

from kiln.components.optimizers.memory import optimizer_state_bytes
from kiln.parallelisms.layout.check import chunked_loss_note, training_problems
from kiln.parallelisms.layout.mesh import layout
from kiln.recipes.preflight.layout_plan import dry_parallelize, fake_world, local_bytes, local_numel
from kiln.recipes.training.activation_memory import measure
from kiln.recipes.training.optimizer_set import OptimizerSet

PROBE = (256, 256)  # large enough for blockwise 8-bit states, small enough to step at once


def state_bytes_per_element(cfg) -> float:
    """Optimizer-state bytes per parameter element of optimizer config ``cfg`` (one real step
    on a ``PROBE`` matrix)."""
    probe = torch.nn.Parameter(torch.zeros(PROBE))
    probe.grad = torch.full(PROBE, 1e-3)
    opt = cfg.build([{"params": [probe], "lr": cfg.lr, "peak_lr": cfg.lr,
                      "weight_decay": 0.0, "name": "probe"}])
    opt.step()
    return optimizer_state_bytes(opt) / probe.numel()


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.2f} MiB"


def _rank_memory(recipe, model, plan_fn) -> tuple[str, int, int, dict[str, float]]:
    """(plan summary, parameter, gradient and per-optimizer state bytes) of one rank."""
    plan = plan_fn(model)
    params = list(model.parameters())
    param_bytes = local_bytes(params)
    grad_bytes = local_bytes(p for p in params if p.requires_grad)
    opts = OptimizerSet(model, recipe.optimizer_tables(), recipe.training.steps or 1)
    per_opt = {}
    for name, route_ in opts.routes.items():
        if name not in opts.optimizers:
            continue
        elements = sum(local_numel(p) for _, p in (*route_.decay, *route_.no_decay))
        per_opt[name] = elements * state_bytes_per_element(opts.tables[name])
    return plan.summary, param_bytes, grad_bytes, per_opt


def _memory_lines(param_bytes: int, grad_bytes: int, per_opt: dict[str, float],
                  indent: str) -> list[str]:
    total = param_bytes + grad_bytes + sum(per_opt.values())
    return [
        f"{indent}parameters        {_gib(param_bytes)}",
        f"{indent}gradients         {_gib(grad_bytes)}",
        f"{indent}optimizer state   " + _gib(sum(per_opt.values())) + " ("
        + ", ".join(f"{k} {_gib(v)}" for k, v in per_opt.items()) + ")",
        f"{indent}total             {_gib(total)} (parameters, gradients, optimizer state)",
    ]


def layout_report(recipe, model_builder, world_size: int, grad_accum: int = 1) -> str:
    """Lines for ``kiln validate``: mesh, plan and rank 0's memory at ``world_size`` ranks
    (with a pipeline: one rank per stage, and the schedule's bubble). ``model_builder()`` builds
    the recipe's model on the meta device; ``grad_accum``: micro-batches per step and rank."""
    pcfg = recipe.parallelism
    shape = layout(pcfg, world_size)
    lines = [f"layout at world size {world_size}: mesh {shape.describe()}"]
    with fake_world(world_size):
        for pp_rank in range(shape.pp):
            summary, params, grads, per_opt = _rank_memory(
                recipe, model_builder(), lambda m, r=pp_rank: dry_parallelize(
                    m, pcfg, world_size, rank=r * shape.stage_ranks, training=recipe.training,
                    grad_accum=grad_accum))
            if pp_rank == 0:
                lines.append(f"  plan: {summary}")
            if shape.pp == 1:
                lines.append("  per rank (rank 0, the largest shards):")
                lines += _memory_lines(params, grads, per_opt, "    ")
                continue
            if pp_rank == 0:
                lines.append("  per rank of each pipeline rank's stages (its data-parallel "
                             "rank 0):")
            lines.append(f"    pipeline rank {pp_rank} (rank {pp_rank * shape.stage_ranks}): "
                         + ", ".join(_stage_names(pcfg, pp_rank)))
            lines += _memory_lines(params, grads, per_opt, "      ")
    if shape.pp == 1:
        lines += activation_lines(recipe, model_builder, world_size, shape)
    else:
        from kiln.parallelisms.pipeline.schedule import bubble_fraction
        from kiln.parallelisms.pipeline.split import runs_per_step

        runs, per_run = runs_per_step(pcfg, grad_accum)
        lines.append(f"  pipeline bubble: {bubble_fraction(pcfg, per_run):.1%} of each run idle "
                     f"({pcfg.pp_schedule}, {per_run} micro-batches per run x {runs} runs per "
                     "step; timetable with backward = 2 x forward)")
        lines.append("  activations: not measured per stage (a rank keeps its stages' share "
                     "for every micro-batch in flight: all of them under gpipe, up to pp under "
                     "1f1b); kiln bench measures a run")
    if note := chunked_loss_note(recipe.training, shape.tp):
        lines.append(f"  note: {note}")
    return "\n".join(lines)


def activation_lines(recipe, model_builder, world_size: int, shape) -> list[str]:
    """Activations per rank at the recipe's cp, and at every other cp the layout allows."""
    tr = recipe.training
    options = [c for c in range(1, world_size // shape.tp + 1)
               if (world_size // shape.tp) % c == 0 and not training_problems(tr, shape.tp, c)]
    try:
        measured = {c: measure(recipe, model_builder, c) for c in options}
    except Exception as exc:  # noqa: BLE001 - a model whose forward cannot run on meta
        return [f"    activations       not measured: the forward does not run on the meta "
                f"device ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"]
    total, mask = measured.get(shape.cp, (0, 0))
    tokens = f"{tr.micro_batch} x {tr.seq_len // shape.cp} tokens"
    tp = f"; tensor parallel divides most of it by {shape.tp}" if shape.tp > 1 else ""
    lines = [f"    activations       {_gib(total)} per micro-batch ({tokens}, fp32, measured on "
             f"meta{tp})"]
    if mask:
        lines.append(f"      of which the dense attention mask {_gib(mask)} (sdpa kernel; "
                     "CUDA's flex kernel keeps a block mask instead)")
    if len(measured) > 1:
        lines.append("  activations by parallelism.cp (seq_len " + f"{tr.seq_len}): " + ", ".join(
            f"cp {c}: {_gib(t)}" for c, (t, _) in measured.items()))
    return lines


def _stage_names(pcfg, pp_rank: int) -> list[str]:
    from kiln.parallelisms.pipeline.split import rank_stages

    return [f"stage {s}" for s in rank_stages(pcfg, pp_rank)]

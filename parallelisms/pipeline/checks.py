"""What a recipe with ``parallelism.pp > 1`` must satisfy, each problem naming its keys.

Called by ``parallelize`` (``kiln train``) and by ``kiln validate``, so both refuse the same
recipes with the same words. Some combinations are refused because they do not work yet; each
message says why (docs/pipeline.md "What does not compose yet").
"""

from __future__ import annotations

from torch import nn

from kiln.parallelisms.pipeline.schedule import microbatch_problem
from kiln.parallelisms.pipeline.split import SCHEDULES, runs_per_step, split_problems


def pipeline_problems(cfg, training, model: nn.Module, grad_accum: int,
                      checkpoint=None, attention=None) -> list[str]:
    """Problems of ``[parallelism]`` pp settings against the model, ``[training]`` (``grad_accum``
    micro-batches per step and data-parallel rank), ``[checkpoint]`` and ``[model.attention]``."""
    if cfg.pp <= 1:
        return []
    pp = f"parallelism.pp = {cfg.pp}"
    if not (hasattr(model, "stage_forward") and hasattr(model, "pipeline_ends")
            and isinstance(getattr(model, "layers", None), nn.ModuleDict)):
        return [f"{pp}: {type(model).__name__} cannot be split into pipeline stages (it lacks "
                "the stage contract of docs/design.md: layers, pipeline_ends, stage_forward); "
                "a looped model reruns its core blocks H times per forward, so its stages "
                "would pass activations back and forth H times: set parallelism.pp = 1"]
    problems = split_problems(cfg, len(model.layers))
    if getattr(model, "mtp", None) is not None:
        problems.append(f"model.mtp_depth with {pp} is not supported yet: the modules need the "
                        "trunk's last hidden states and the embeddings, on different stages; "
                        "set model.mtp_depth = 0 or pp = 1")
    step = getattr(getattr(training, "step", None), "type", "standard")
    if step != "standard":
        problems.append(f"training.step.type = \"{step}\" cannot run under {pp}: the pipeline "
                        "runs inside the standard step; use step \"standard\" or pp = 1")
    if cfg.pp_microbatches and grad_accum % cfg.pp_microbatches:
        problems.append(
            f"parallelism.pp_microbatches = {cfg.pp_microbatches} does not divide the "
            f"{grad_accum} micro-batches of a step per data-parallel rank (training.grad_accum, "
            "from global_batch / (micro_batch x data-parallel ranks)); use a divisor or 0")
    else:
        problem = microbatch_problem(cfg, runs_per_step(cfg, grad_accum)[1])
        if problem:
            problems.append(f"{pp}: {problem}")
    if cfg.cp > 1:
        problems.append(f"parallelism.cp = {cfg.cp} with {pp} is not supported yet: the stages "
                        "would pass each rank's sequence chunks and the attention context of "
                        "every micro-batch; use one of them")
    if getattr(attention, "document_mask", False):
        problems.append(f"model.attention.document_mask = true with {pp} is not supported yet: "
                        "each micro-batch's mask would have to travel with it through the "
                        "schedule; set document_mask = false or pp = 1")
    if cfg.compile and SCHEDULES[cfg.pp_schedule][0].endswith(("ZeroBubble", "DualPipeV")):
        problems.append(f"parallelism.compile = true with pp_schedule = \"{cfg.pp_schedule}\": "
                        "torch's zero-bubble schedules split each backward in two, which "
                        "compiled blocks do not support; use 1f1b / interleaved_1f1b or "
                        "compile = false")
    if checkpoint is not None and checkpoint.export_at_end:
        problems.append(f"checkpoint.export_at_end = true with {pp}: each rank holds only its "
                        "stages; export the final checkpoint with `kiln export` instead")
    if checkpoint is not None and checkpoint.init_from:
        problems.append(f"checkpoint.init_from with {pp} is not supported yet: start the run "
                        "on pp = 1, save a checkpoint and resume it with pp (elastic resume)")
    return problems

"""Pipeline parallelism: this rank's stages of the model, run by a torch.distributed.pipelining
schedule inside the step.

``split_model`` prunes the model in place to the blocks and end modules of this rank's stages
(``pipeline_split`` decides which), so the model keeps the parameter names of the whole model
(``layers.5.attention.wq.weight``): optimizers, checkpoints (DCP, elastic across pipeline
layouts) and metrics see one ordinary model per rank. Each stage is a ``StagePart``: a module
whose children are the modules that stage runs (the FSDP2 root of that stage, and what
``PipelineStage`` computes gradients for) and whose forward is the family's ``stage_forward``.
The last stage also computes the loss (through the trainer's own loss code, so the chunked loss
and loss parallel work as without a pipeline); tokens flow in on the first stage.

A step (``Pipeline.train``) runs the step's micro-batches through the schedule in
``pp_microbatches``-sized runs; the loss, divided by the step's micro-batch count exactly as the
standard step divides it, is broadcast from the last stage, so every rank logs, guards and clips
on the same numbers. An embedding matrix tied to the head lives on the first and the last stage:
its two gradients are summed between them (``sync_shared_grads``) and both take the same step.
Evaluation sends one micro-batch through the stages forward only (nothing to overlap).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from kiln.components import distributed
from kiln.components.distributed import is_dtensor, local_tensor
from kiln.parallelisms.pipeline.schedule import build_schedule, hidden_dtype
from kiln.parallelisms.pipeline.split import (
    layer_split,
    num_stages,
    rank_stages,
    runs_per_step,
    stage_layers,
    stage_rank,
)


class _AuxGrad(torch.autograd.Function):
    """Identity on the stage output that gives an auxiliary loss (MoE balance) of this stage the
    gradient ``scale`` in backward: the stage's output is all the schedule backpropagates."""

    @staticmethod
    def forward(ctx, hidden, aux, scale):  # noqa: D401
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype,
                                device=grad.device), None


@dataclass
class RunContext:
    """What the stages need from the trainer during a run (set per call)."""

    loss_of: Any = None  # (run(**kw), labels) -> loss: the trainer's stage_loss
    autocast: Any = None  # a context manager for the forward
    n_total: int = 1  # micro-batches in the optimizer step (the loss divisor)


class StagePart(nn.Module):
    """One stage: its blocks and end modules as children, forward through the model family's
    ``stage_forward``; the last stage returns the micro-batch's loss."""

    def __init__(self, model: nn.Module, index: int, keys: list[str], *, first: bool,
                 last: bool, ends: list[str], ctx: RunContext) -> None:
        super().__init__()
        self.index, self.keys, self.first, self.last = index, keys, first, last
        self.blocks = nn.ModuleList([model.layers[k] for k in keys])
        for name in ends:
            setattr(self, name, getattr(model, name))
        object.__setattr__(self, "_model", model)  # not a child: no second owner of the rest
        object.__setattr__(self, "_ctx", ctx)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        model, ctx = self._model, self._ctx
        if self.last:
            def run(**kw):
                return model.stage_forward(x, self.keys, first=self.first, last=True, **kw)

            return ctx.loss_of(run, labels)  # (): fp32 loss of the micro-batch
        with ctx.autocast:
            h = model.stage_forward(x, self.keys, first=self.first, last=False)  # (B, T, D)
        pop = getattr(model, "pop_aux_loss", None)
        aux = pop() if pop is not None and self.training else None
        return h if aux is None else _AuxGrad.apply(h, aux, 1.0 / ctx.n_total)


def _end_modules(model: nn.Module, first: bool, last: bool) -> list[str]:
    """Names of the end modules a stage holds; a first-stage module whose parameter the head
    shares (tied embeddings) goes with the last stage too."""
    ends = model.pipeline_ends
    names = list(ends["first"]) if first else []
    if last:
        head = {id(p) for n in ends["last"] for p in getattr(model, n).parameters()}
        names += [n for n in ends["first"] if n not in names and getattr(model, n) is not None
                  and any(id(p) in head for p in getattr(model, n).parameters())]
        names += list(ends["last"])
    return names


def shared_end_params(model: nn.Module) -> list[str]:
    """Names of first-stage parameters the last stage also uses (a tied embedding)."""
    ends = model.pipeline_ends
    head = {id(p) for n in ends["last"] for p in getattr(model, n).parameters()}
    return [f"{n}.{pn}" for n in ends["first"]
            for pn, p in getattr(model, n).named_parameters() if id(p) in head]


@dataclass
class Pipeline:
    """This rank's stages and the per-step calls that run them."""

    cfg: Any
    model: nn.Module
    stages: list[int]  # stage indices on this rank
    keys: list[list[str]]  # block keys of every stage
    pp_rank: int
    stage_ranks: int  # ranks per pipeline slice
    rank: int
    device: torch.device
    runs: int
    per_run: int
    shared: list[str]  # tied parameter names (first and last stage)
    skeleton: nn.Module | None = None  # the whole meta model, for replica init (then dropped)
    group: Any = None  # the pp process group (this rank's slice peers)
    stage_group: Any = None  # the ranks of this rank's stage (dp x tp)
    tied_group: Any = None  # first + last stage ranks of this data-parallel index
    hidden: torch.dtype = torch.float32
    tp: int = 1
    loss_context: Any = contextlib.nullcontext  # around forward + backward (loss parallel)
    ctx: RunContext = field(default_factory=RunContext)
    parts: list[StagePart] = field(default_factory=list)
    _schedules: dict = field(default_factory=dict)

    @property
    def n_stages(self) -> int:
        return len(self.keys)

    def global_rank(self, stage: int) -> int:
        """The rank holding ``stage`` in this rank's data-parallel / tensor-parallel position."""
        return stage_rank(self.cfg, stage) * self.stage_ranks + self.rank % self.stage_ranks

    def describe(self) -> str:
        counts = "/".join(str(len(k)) for k in self.keys)
        return (f"pipeline {self.cfg.pp} ({self.cfg.pp_schedule}, {self.n_stages} stages of "
                f"{counts} layers, {self.per_run} micro-batches per run x {self.runs})")

    def build_parts(self) -> None:
        """The stage modules (after activation checkpointing / compile swapped the blocks)."""
        last = self.n_stages - 1
        self.parts = [
            StagePart(self.model, s, self.keys[s], first=s == 0, last=s == last,
                      ends=_end_modules(self.model, s == 0, s == last), ctx=self.ctx)
            for s in self.stages]

    # ---------------------------------------------------------------------------- training
    def _schedule(self, rows: int, seq: int):
        """A schedule for micro-batches of ``rows`` x ``seq`` (one per shape: context warmup
        changes it; stages are told the shapes, so no trial forward runs)."""
        key = (rows, seq)
        if key not in self._schedules:
            from torch.distributed.pipelining import PipelineStage

            dim = self.model.dim
            hidden = torch.empty(rows, seq // self.tp, dim, dtype=self.hidden, device=self.device)
            stages = []
            for part in self.parts:
                inp = (torch.empty(rows, seq, dtype=torch.long, device=self.device) if part.first
                       else hidden.clone().requires_grad_(True))
                out = (torch.empty((), device=self.device, requires_grad=True) if part.last
                       else hidden.clone().requires_grad_(True))
                stages.append(PipelineStage(part, part.index, self.n_stages, self.device,
                                            input_args=inp, output_args=out, group=self.group))
            self._schedules[key] = build_schedule(self.cfg, stages, self.per_run,
                                                  self._scaled_loss)
        return self._schedules[key]

    def _scaled_loss(self, loss: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return loss / self.ctx.n_total  # as the standard step: each micro-batch's mean / n

    def train(self, micro_batches: list[dict[str, torch.Tensor]], loss_of, autocast
              ) -> torch.Tensor:
        """Forward and backward of the step's micro-batches; the summed (mean) loss, the same
        on every rank."""
        self.ctx.loss_of, self.ctx.autocast = loss_of, autocast
        self.ctx.n_total = len(micro_batches)
        ids = torch.cat([b["input_ids"] for b in micro_batches])  # (n * mb, T)
        labels = torch.cat([b["labels"] for b in micro_batches])
        rows = micro_batches[0]["input_ids"].shape[0]
        schedule = self._schedule(rows, ids.shape[1])
        total = torch.zeros((), device=self.device)
        span = self.per_run * rows
        for r in range(self.runs):
            part_ids, part_labels = ids[r * span:(r + 1) * span], labels[r * span:(r + 1) * span]
            losses: list[torch.Tensor] = []
            args = (part_ids,) if 0 in self.stages else ()
            with self.loss_context():
                schedule.step(*args, target=part_labels, losses=losses, return_outputs=False,
                              labels=part_labels)
            for loss in losses:
                total += loss.detach()
        return self._from_last(total)

    def _from_last(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` as the last stage computed it, on every rank of the pipeline."""
        return distributed.broadcast_(value, src=self.global_rank(self.n_stages - 1),
                                      group=self.group)

    def sync_shared_grads(self) -> None:
        """Sum a tied matrix's gradients of the first and the last stage (both hold it)."""
        if self.tied_group is None:
            return
        params = dict(self.model.named_parameters())
        for name in self.shared:
            p = params.get(name)
            if p is None or p.grad is None:
                continue
            if is_dtensor(p.grad) and p.grad.placements != p.placements:
                # tensor parallel: the embedding's gradient may come back replicated where its
                # weight is a row shard; both stages must send the same shard
                p.grad = p.grad.redistribute(placements=p.placements)
            distributed.all_reduce_(local_tensor(p.grad), group=self.tied_group)

    def copies(self) -> dict[int, int]:
        """How many pipeline stages hold each parameter more than once (grad norm)."""
        if self.tied_group is None:
            return {}
        params = dict(self.model.named_parameters())
        return {id(params[n]): 2 for n in self.shared if n in params}

    # ---------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def eval_loss(self, batch: dict[str, torch.Tensor], loss_of, autocast) -> torch.Tensor:
        """Mean loss of one micro-batch, forward through the stages in order; every rank gets
        it (the last stage's value)."""
        self.ctx.loss_of, self.ctx.autocast, self.ctx.n_total = loss_of, autocast, 1
        ids, labels = batch["input_ids"], batch["labels"]
        out = torch.zeros((), device=self.device)
        b, t = ids.shape
        by_index = {p.index: p for p in self.parts}
        h = None
        for s in self.stages:
            part = by_index[s]
            if part.first:
                x = ids
            elif s - 1 in by_index:
                x = h
            else:
                x = torch.empty(b, t // self.tp, self.model.dim, dtype=self.hidden,
                                device=self.device)
                distributed.recv_(x, src=self.global_rank(s - 1))
            with self.loss_context():
                h = part(x, labels=labels)
            if part.last:
                out = h.detach().float()
            elif s + 1 not in by_index:
                distributed.send_(h.contiguous(), dst=self.global_rank(s + 1))
        return self._from_last(out)


def split_model(model: nn.Module, cfg, mesh, *, rank: int, device: torch.device,
                seq_len: int, grad_accum: int, fsdp: bool) -> Pipeline:
    """Prune ``model`` in place to this rank's stages; the ``Pipeline`` that runs them."""
    from kiln.parallelisms.blocks import model_blocks

    keys = list(model.layers.keys())
    counts = layer_split(cfg, model, model_blocks(model), seq_len)
    per_stage = stage_layers(counts, keys)
    stage_ranks = mesh.size() // cfg.pp
    pp_rank = rank // stage_ranks
    stages = rank_stages(cfg, pp_rank)
    n = num_stages(cfg)
    runs, per_run = runs_per_step(cfg, grad_accum)
    shared = shared_end_params(model)
    skeleton = copy.deepcopy(model) if next(model.parameters()).is_meta else None
    keep = {k for s in stages for k in per_stage[s]}
    for k in keys:
        if k not in keep:
            del model.layers[k]
    ends = set()
    for s in stages:
        ends.update(_end_modules(model, s == 0, s == n - 1))
    for name in (*model.pipeline_ends["first"], *model.pipeline_ends["last"]):
        if name not in ends:
            setattr(model, name, None)
    model.__dict__.pop("_moe_cache", None)  # its MoE layers are this rank's now
    pipe = Pipeline(cfg=cfg, model=model, stages=stages, keys=per_stage, pp_rank=pp_rank,
                    stage_ranks=stage_ranks, rank=rank, device=device, runs=runs,
                    per_run=per_run, shared=shared, skeleton=skeleton,
                    hidden=hidden_dtype(cfg, fsdp), tp=cfg.tp)
    _groups(pipe, mesh)
    model.balance_group = pipe.stage_group  # MoE loads: summed over this stage's ranks only
    return pipe


def _groups(pipe: Pipeline, mesh) -> None:
    pipe.group = mesh["pp"].get_group()
    rest = [d for d in mesh.mesh_dim_names if d != "pp"]
    pipe.stage_group = mesh[tuple(rest)]._flatten("pp_stage").get_group()
    if not pipe.shared:
        return
    first, last = stage_rank(pipe.cfg, 0), stage_rank(pipe.cfg, pipe.n_stages - 1)
    if first == last:  # V schedules: both on one rank, one parameter
        return
    for i in range(pipe.stage_ranks):  # every rank creates every group, in the same order
        group = dist.new_group([first * pipe.stage_ranks + i, last * pipe.stage_ranks + i])
        if pipe.rank % pipe.stage_ranks == i and pipe.pp_rank in (first, last):
            pipe.tied_group = group

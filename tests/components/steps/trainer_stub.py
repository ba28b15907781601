"""A Trainer with the real step helpers (zero_grad, forward_loss, sync_grads, clip_grads,
global_stats, guard_decision, optimizer_step) around a given model, without data or run
folder: step components are tested against the code they really call."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from kiln.components.base import default_config
from kiln.components.distributed import World
from kiln.parallelisms import ParallelPlan
from kiln.recipes.training.model_inputs import ModelInputs
from kiln.recipes.training.optimizer_set import OptimizerSet
from kiln.recipes.training.trainer import Progress, Trainer


class StubTrainer(Trainer):
    def __init__(self, model: torch.nn.Module, *, optimizers: dict | None = None,
                 guards: dict | None = None, total_steps: int = 100, grad_clip: float = 1.0,
                 tokens_per_step: int = 0, rank: int = 0, world_size: int = 1) -> None:
        self.model = model
        self.device = torch.device("cpu")
        self.world = World(rank, world_size, rank, self.device)
        self.parallel = ParallelPlan(model=model, world_size=world_size,
                                     replicated=world_size > 1)
        self.recipe = SimpleNamespace(training=SimpleNamespace(grad_clip=grad_clip,
                                                             loss_chunk_tokens=0))
        tables = optimizers or {"main": default_config("optimizer", "adamw", lr=1e-3)}
        self.total_steps = total_steps
        self.optimizers = OptimizerSet(model, tables, total_steps)
        self.guards = guards or {}
        self.progress = Progress()
        # tokens_per_step = global_batch x current seq_len: a batch of one "sequence" this long.
        self.plan = SimpleNamespace(global_batch=1)
        self.seq_len = tokens_per_step
        self.autocast = contextlib.nullcontext()
        self.model_inputs = ModelInputs(None, self.device)  # plain causal, one process
        self.watchdog = SimpleNamespace(step_ends=lambda step: None)  # no run to watch

    def run(self, step_fn, micro_batches: list[dict[str, torch.Tensor]]):
        """One step as ``fit`` runs it (set_progress, the step, the step counter)."""
        set_progress = getattr(self.model, "set_progress", None)
        if set_progress is not None:
            set_progress(self.progress.step, self.total_steps)
        result = step_fn(self, micro_batches)
        self.end_step(result)
        return result

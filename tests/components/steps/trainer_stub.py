"""A step context around a given model, without a trainer, data or run folder: step components
are tested against the code they really call (``TrainStepContext``), as ``Trainer.fit`` runs
them."""

from __future__ import annotations

import torch

from kiln.components.base import default_config
from kiln.components.distributed import World
from kiln.components.protocols import complete_model
from kiln.parallelisms import ParallelPlan
from kiln.recipes.training.model_inputs import ModelInputs
from kiln.recipes.training.optimizer_set import OptimizerSet
from kiln.recipes.training.step_context import Progress, TrainStepContext


class StubTrainer(TrainStepContext):
    def __init__(self, model: torch.nn.Module, *, optimizers: dict | None = None,
                 guards: dict | None = None, total_steps: int = 100, grad_clip: float = 1.0,
                 tokens_per_step: int = 0, rank: int = 0, world_size: int = 1) -> None:
        device = torch.device("cpu")
        tables = optimizers or {"main": default_config("optimizer", "adamw", lr=1e-3)}
        # tokens_per_step = global_batch x current seq_len: a batch of one "sequence" this long.
        super().__init__(
            model=complete_model(model), world=World(rank, world_size, rank, device),
            parallel=ParallelPlan(model=model, world_size=world_size, replicated=world_size > 1),
            model_inputs=ModelInputs(None, device),  # plain causal, one process
            optimizers=OptimizerSet(model, tables, total_steps), guards=guards or {},
            progress=Progress(), total_steps=total_steps, global_batch=1,
            seq_len=tokens_per_step, grad_clip=grad_clip)

    def run(self, step_fn, micro_batches: list[dict[str, torch.Tensor]]):
        """One step as ``fit`` runs it (set_progress, the step, the step counter)."""
        self.model.set_progress(self.progress.step, self.total_steps)
        result = step_fn(self, micro_batches)
        self.progress.step += 1
        self.progress.tokens += result.tokens
        self.model.on_global_step(result.skipped)
        return result

"""Downstream tasks in the training loop (``[evals.NAME]`` tables): each task every ``interval``
steps and after the last one, its batches split over the data-parallel ranks, the metrics logged
as ``eval/<task>/<metric>`` (console, metrics.jsonl, TensorBoard, W&B).

Evaluation leaves training as it was: the model goes to eval mode and back, the RNG states are
saved and restored, no data loader is touched, and everything runs under ``no_grad``; tasks are
read and planned before the first step, so bad task data stops a run before it trains.

``mode = "pause"`` (the looped MoE reference's hand-off): save a snapshot, write
``pending_downstream_eval.json`` (step, checkpoint, tasks) in the run folder and stop (exit 0);
a scheduler runs ``kiln eval RUN --pending`` elsewhere, and the same training command resumes.
The snapshot is published before the request is written: a resume at a step whose pause tasks
are neither pending nor scored (a run killed in between) writes the request and pauses again.
Rotation spares a snapshot a pending request names (``pending_snapshots``).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import torch

from kiln.checkpointing import layout
from kiln.components import devices, distributed
from kiln.components.errors import RecipeError
from kiln.components.protocols import Hook
from kiln.components.tasks import runner
from kiln.components.tasks.scorer import Scorer
from kiln.recipes.inference.pending import PENDING, requested, write_pending
from kiln.recipes.inference.task_plans import format_metrics, greedy_generate, plan_evals
from kiln.recipes.runs import unit_scores


class RngState:
    """Every generator training could read: torch (CPU and the accelerator's), Python's and
    NumPy's."""

    def __init__(self) -> None:
        self.torch = torch.get_rng_state()
        self.kind = devices.rng_device_type()  # the accelerator in use, if any
        self.device = devices.rng_states(self.kind) if self.kind is not None else None
        self.python = random.getstate()
        self.numpy = np.random.get_state()

    def restore(self) -> None:
        torch.set_rng_state(self.torch)
        if self.device is not None:
            devices.set_rng_states(self.kind, self.device)
        random.setstate(self.python)
        np.random.set_state(self.numpy)


class DownstreamEvalHook(Hook):
    """Each ``[evals.NAME]`` task every ``interval`` steps and at the end, or a pause."""

    priority = 50

    def __init__(self) -> None:
        self.tasks: dict = {}
        self.plans: dict = {}
        self.fingerprints: dict[str, str] = {}

    def on_train_start(self, trainer) -> None:
        if not trainer.recipe.evals:
            return
        self.tasks, self.plans, self.max_len = plan_evals(
            trainer.recipe, trainer.model, trainer.tokenizer, trainer.mesh_layout,
            distributed=trainer.world.distributed, log=trainer.print)
        self.fingerprints = {n: t.fingerprint() for n, t in self.tasks.items()}
        self.scorer = Scorer(trainer.model, max_len=self.max_len,
                             vocab_size=trainer.tokenizer.vocab_size, autocast=trainer.autocast,
                             generate=greedy_generate(), lockstep=trainer.world.distributed)
        self._ask_again(trainer)

    def _ask_again(self, trainer) -> None:
        """A pause publishes its snapshot before it writes the request, so a run killed in
        between resumes at that step with nothing asked: ask now for what the step owes (its
        pause tasks neither pending nor scored) and pause as the killed run would have."""
        step = trainer.progress.step
        if step == 0:
            return
        due = self._due(trainer, step, end=False)
        if step >= trainer.total_steps:
            due += self._due(trainer, step, end=True)
        paused = [n for n in due if trainer.recipe.evals[n].mode == "pause"]
        if not paused:
            return
        owed = None
        if trainer.world.is_main:
            asked = requested(Path(trainer.run_dir), trainer.print)
            owed = [n for n in paused if (step, n) not in asked]
        if trainer.world.distributed:
            owed = distributed.broadcast_object(owed)
        if owed:
            trainer.print(f"kiln: step {step} was saved for a downstream evaluation that was "
                          "never requested (the run stopped in between): requesting it now")
            self.pause(trainer, owed, None)

    def _due(self, trainer, step: int, *, end: bool) -> list[str]:
        last = step == trainer.total_steps
        return [n for n, c in trainer.recipe.evals.items()
                if (c.at_end if end else
                    c.interval and step % c.interval == 0 and not (c.at_end and last))]

    def on_step_end(self, trainer, result) -> None:
        self._run(trainer, self._due(trainer, trainer.progress.step, end=False), result.loss)

    def on_train_end(self, trainer) -> None:
        if not trainer.stop_requested and trainer.progress.step >= trainer.total_steps:
            self._run(trainer, self._due(trainer, trainer.progress.step, end=True), None)

    def _run(self, trainer, names: list[str], loss: float | None) -> None:
        inline = [n for n in names if n in self.tasks]
        if inline:
            self.evaluate(trainer, inline)
        paused = [n for n in names if n not in self.tasks]
        if paused:
            self.pause(trainer, paused, loss)

    def evaluate(self, trainer, names: list[str]) -> dict[str, dict[str, float]]:
        model, step = trainer.model, trainer.progress.step
        was_training = model.training
        rng = RngState()
        model.eval()
        out: dict[str, dict[str, float]] = {}
        try:
            with torch.no_grad():
                for name in names:
                    started = time.perf_counter()
                    task, plan = self.tasks[name], self.plans[name]
                    values = runner.score(task, plan, self.scorer, rank=trainer.data_rank,
                                          world_size=trainer.data_ranks)
                    out[name] = metrics = task.summarize(values)
                    # each metric with its standard error, the examples it averages and what
                    # they were: `kiln compare` pairs runs on the per-example scores kept here
                    trainer.metrics.log(step, {
                        **{f"eval/{name}/{k}": v for k, v in metrics.items()},
                        f"eval/{name}/examples": plan.examples,
                        f"eval/{name}/fingerprint": self.fingerprints[name]})
                    if trainer.world.is_main:
                        unit_scores.save(trainer.run_dir, name, step, values.numpy(),
                                         plan.columns)
                    trainer.print(f"eval  step {step}  " + format_metrics(
                        name, metrics, self.plans[name].examples, time.perf_counter() - started))
        finally:
            rng.restore()
            model.train(was_training)
        return out

    def pause(self, trainer, names: list[str], loss: float | None) -> None:
        """Save a snapshot (unless this step has one), write the pending file and stop."""
        hook = next((h for h in trainer.hooks if hasattr(h, "manager")), None)
        if hook is None:
            raise RecipeError("mode = \"pause\" needs the checkpoint hook (checkpoint.enable)")
        step = trainer.progress.step
        if hook.manager.last_saved_step != step:  # a failed save stops the run (final)
            hook.manager.save(trainer, extra={"loss": loss}, final=True)
        hook.manager.wait(final=True)
        folder = (hook.root / layout.step_name(step)).resolve()
        run_dir = Path(trainer.run_dir).resolve()
        if folder.is_relative_to(run_dir):  # the request moves with the run folder
            folder = folder.relative_to(run_dir)
        if trainer.world.is_main:
            write_pending(Path(trainer.run_dir), step, folder, {
                n: trainer.recipe.evals[n].model_dump(mode="json") for n in names}, trainer.print)
        final = step >= trainer.total_steps
        if not final:
            trainer.stop_requested = True
        trainer.print(f"kiln: downstream evaluation of step {step} ({', '.join(names)}) is "
                      f"pending: {Path(trainer.run_dir) / PENDING}. Run `kiln eval "
                      f"{trainer.run_dir} --pending` (any machine)"
                      + ("" if final else ", then rerun this command to continue training."))

"""The trainer's hooks, from the recipe's ``[run]`` and ``[hooks.NAME]`` tables.

The trainer runs them by ``priority``, highest first (``components/protocols.py``). Per step the
standard hooks run first, then the checkpoint hook, then the plugins' and the caller's hooks
(priority 0): a snapshot is published only after its step's metrics and evaluations are written,
so a crash between the two can repeat a line on resume, never lose one.
"""

from __future__ import annotations

from pathlib import Path

from kiln.components.base import default_config
from kiln.components.protocols import Hook, complete_hook
from kiln.recipes.config.schema import Recipe
from kiln.recipes.hooks.evaluate import EvalHook
from kiln.recipes.hooks.log import LogHook
from kiln.recipes.hooks.progress import ProgressHook
from kiln.recipes.hooks.sources import SourceMetricsHook


def standard_hooks(recipe: Recipe) -> list[Hook]:
    """Every hook the recipe turns on, kiln's and the plugins', in no particular order."""
    run = recipe.run
    hooks: list[Hook] = [run.watchdog.build(), run.routing.build(), LogHook(), EvalHook(),
                         ProgressHook(), SourceMetricsHook()]
    if run.profile is not None:
        hooks.append(run.profile.build())
    if recipe.evals:  # [evals.NAME] downstream tasks
        from kiln.recipes.hooks.downstream import DownstreamEvalHook

        hooks.append(DownstreamEvalHook())
    if run.diagnostics is not None:
        hooks.append(run.diagnostics.build())
    if run.plot_interval:
        hooks.append(default_config("hook", "plot", interval=run.plot_interval).build())
    return hooks + [cfg.build() for cfg in recipe.hooks.values()]


def by_priority(hooks: list[Hook]) -> list[Hook]:
    """Highest priority first; equal priorities keep their order (``sorted`` is stable)."""
    return sorted(map(complete_hook, hooks), key=lambda h: -h.priority)


def checkpoint_hook(trainer) -> Hook:
    """The checkpoint hook, given what it needs from this floor (recipe diff, export)."""
    from kiln.checkpointing.hook import CheckpointHook
    from kiln.recipes.config.diff import diff
    from kiln.recipes.config.files import load_recipe
    from kiln.recipes.inference.saved_model import export_trainer_model

    return CheckpointHook(trainer, recipe_diff=lambda folder: diff(load_recipe(folder),
                                                                   trainer.recipe),
                          export=lambda out: export_trainer_model(trainer, out),
                          keep=lambda root: _pending_snapshots(Path(trainer.run_dir), root))


def _pending_snapshots(run_dir: Path, root: Path) -> set[str]:
    """Snapshots a pending downstream evaluation needs (rotation spares them); the evaluation
    modules are imported only when the run folder holds a request."""
    if not any(run_dir.glob("pending_downstream_eval*.json")):
        return set()
    from kiln.recipes.inference.pending import pending_snapshots

    return pending_snapshots(run_dir, root)

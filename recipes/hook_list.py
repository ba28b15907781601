"""The trainer's hooks, in order, from the recipe's ``[run]``.

Per step the standard hooks run first, then the checkpoint hook, then the caller's hooks: a
snapshot is published only after its step's metrics (and evaluations) are written, so a crash
between the two can repeat a line on resume, never lose one. ``on_train_start`` runs the
checkpoint hook first all the same (``start_order``): it resumes, and the others start from the
resumed progress.
"""

from __future__ import annotations

from pathlib import Path

from kiln.recipes.hooks import EvalHook, Hook, LogHook, ProgressHook
from kiln.recipes.schema import Recipe


def standard_hooks(recipe: Recipe, watchdog: Hook) -> list[Hook]:
    """Profiling first (its window brackets the other hooks' work too), routing health before
    logging (its figures join the log line), evaluations, module diagnostics (they arm their
    module hooks for the next step after the evaluations ran), plots (they read what the others
    wrote), the progress bar, and the hang ``watchdog`` last (the trainer's own instance: the
    loop marks each step's window on it)."""
    run = recipe.run
    hooks: list[Hook] = []
    if run.profile is not None:
        from kiln.recipes.profiling import ProfileHook

        hooks.append(ProfileHook(run.profile))
    from kiln.recipes.routing_hook import RoutingHook

    hooks += [RoutingHook(run.routing), LogHook(), EvalHook()]
    if recipe.evals:  # [evals.NAME] downstream tasks
        from kiln.recipes.downstream import DownstreamEvalHook

        hooks.append(DownstreamEvalHook())
    if run.diagnostics is not None:
        from kiln.recipes.diagnostics import DiagnosticsHook

        hooks.append(DiagnosticsHook(run.diagnostics))
    if run.plot_interval:
        from kiln.recipes.plots import PlotHook

        hooks.append(PlotHook(run.plot_interval))
    return [*hooks, ProgressHook(), watchdog]


def start_order(hooks: list[Hook], resumer: Hook | None) -> list[Hook]:
    """The order of ``on_train_start``: the checkpoint hook (it resumes) first."""
    return sorted(hooks, key=lambda h: h is not resumer)


def checkpoint_hook(trainer) -> Hook:
    """The checkpoint hook, given what it needs from this floor (recipe diff, export)."""
    from kiln.checkpointing.hook import CheckpointHook
    from kiln.recipes.diff import diff
    from kiln.recipes.recipe import load_recipe
    from kiln.recipes.saved_model import export_trainer_model

    return CheckpointHook(trainer, recipe_diff=lambda folder: diff(load_recipe(folder),
                                                                   trainer.recipe),
                          export=lambda out: export_trainer_model(trainer, out),
                          keep=lambda root: _pending_snapshots(Path(trainer.run_dir), root))


def _pending_snapshots(run_dir: Path, root: Path) -> set[str]:
    """Snapshots a pending downstream evaluation needs (rotation spares them); the evaluation
    modules are imported only when the run folder holds a request."""
    if not any(run_dir.glob("pending_downstream_eval*.json")):
        return set()
    from kiln.recipes.downstream import pending_snapshots

    return pending_snapshots(run_dir, root)

"""The trainer's hooks, in order, from the recipe's ``[run]``.

Per step the standard hooks run first, then the checkpoint hook, then the caller's hooks: a
snapshot is published only after its step's metrics (and evaluations) are written, so a crash
between the two can repeat a line on resume, never lose one. ``on_train_start`` runs the
checkpoint hook first all the same (``start_order``): it resumes, and the others start from the
resumed progress.
"""

from __future__ import annotations

from kiln.recipes.config.schema import Recipe
from kiln.recipes.hooks.core import EvalHook, Hook, LogHook, ProgressHook


def standard_hooks(recipe: Recipe, watchdog: Hook) -> list[Hook]:
    """Profiling first (its window brackets the other hooks' work too), routing health before
    logging (its figures join the log line), evaluations, module diagnostics (they arm their
    module hooks for the next step after the evaluations ran), plots (they read what the others
    wrote), the progress bar, and the hang ``watchdog`` last (the trainer's own instance: the
    loop marks each step's window on it)."""
    run = recipe.run
    hooks: list[Hook] = []
    if run.profile is not None:
        from kiln.recipes.hooks.profiling import ProfileHook

        hooks.append(ProfileHook(run.profile))
    from kiln.recipes.hooks.routing import RoutingHook

    hooks += [RoutingHook(run.routing), LogHook(), EvalHook()]
    if recipe.evals:  # [evals.NAME] downstream tasks
        from kiln.recipes.hooks.downstream import DownstreamEvalHook

        hooks.append(DownstreamEvalHook())
    if run.diagnostics is not None:
        from kiln.recipes.hooks.diagnostics import DiagnosticsHook

        hooks.append(DiagnosticsHook(run.diagnostics))
    if run.plot_interval:
        from kiln.recipes.runs.plots import PlotHook

        hooks.append(PlotHook(run.plot_interval))
    return [*hooks, ProgressHook(), watchdog]


def start_order(hooks: list[Hook], resumer: Hook | None) -> list[Hook]:
    """The order of ``on_train_start``: the checkpoint hook (it resumes) first."""
    return sorted(hooks, key=lambda h: h is not resumer)


def checkpoint_hook(trainer) -> Hook:
    """The checkpoint hook, given what it needs from this floor (recipe diff, export)."""
    from kiln.checkpointing.hook import CheckpointHook
    from kiln.recipes.config.diff import diff
    from kiln.recipes.config.files import load_recipe
    from kiln.recipes.inference.saved_model import export_trainer_model

    return CheckpointHook(trainer, recipe_diff=lambda folder: diff(load_recipe(folder),
                                                                   trainer.recipe),
                          export=lambda out: export_trainer_model(trainer, out))

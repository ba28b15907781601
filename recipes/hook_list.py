"""The trainer's standard hooks after checkpointing, in order, from the recipe's ``[run]``."""

from __future__ import annotations

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

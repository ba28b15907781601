"""Redrawing a run's own plots while it trains (``run.plot_interval``)."""

from __future__ import annotations

from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.protocols import Hook
from kiln.components.registry import register
from kiln.recipes.runs.plots import DIAGNOSTICS_PANELS, draw, draw_panels, require_matplotlib
from kiln.recipes.runs.read import open_run


class PlotConfig(ComponentConfig):
    interval: int = Field(100, ge=1, description="redraw every N steps and at the end")


@register("hook", "plot", config=PlotConfig)
class PlotHook(Hook):
    """``run.plot_interval``: redraw RUN/plots/curves.png (with the expert-load heatmap of an
    MoE run) and RUN/plots/diagnostics.png (when diagnostics ran) every N steps and at the end,
    from the run's own metrics files; main rank only."""

    priority = 30  # reads what the others wrote

    def __init__(self, cfg: PlotConfig) -> None:
        self.interval = cfg.interval

    def on_train_start(self, trainer) -> None:
        if trainer.world.is_main:
            require_matplotlib("run.plot_interval")  # fail before the first step, not after

    def on_step_end(self, trainer, result) -> None:
        step = trainer.progress.step
        if step % self.interval == 0 and step < trainer.total_steps:  # the last: at the end
            self.draw(trainer)

    def on_train_end(self, trainer) -> None:
        # After the evaluation hooks' on_train_end (they have higher priorities): the final
        # evaluation is in.
        self.draw(trainer)

    def draw(self, trainer) -> None:
        if not trainer.world.is_main:
            return
        run = open_run(trainer.run_dir, need_metrics=False)
        if not any("loss" in r for r in run.records):
            return  # nothing logged yet
        folder = trainer.run_dir / "plots"
        draw([run], folder / "curves.png", title=run.label)
        draw_panels(run, folder / "diagnostics.png", DIAGNOSTICS_PANELS)

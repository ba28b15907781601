"""MoE routing health in the run (``[run.routing]``; on for every model with MoE layers): after
each global step the dead-expert counters move on the device; every log interval the figures
join the log line (``moe/layerN/dead``, ``bias_range``, ``bias_drift``, ``moe/dead_experts``),
the per-expert loads and biases go to ``experts.jsonl`` (``kiln plot``'s heatmap) and an expert
dead for ``dead_steps`` steps in a row gets a warning (once, until it takes tokens again).
The counters start at 0 in every process (not checkpointed)."""

from __future__ import annotations

import json

from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.ffn.moe import moe_layers
from kiln.components.ffn.moe_health import RoutingHealth, RoutingSnapshot
from kiln.components.protocols import Hook
from kiln.components.registry import register
from kiln.recipes.runs.read import EXPERTS_FILE


class RoutingConfig(ComponentConfig):
    """Routing health of MoE layers (always on for a model with MoE layers; ``[run.routing]``
    tunes it): expert loads and biases to experts.jsonl every log interval, dead experts."""

    dead_below: float = Field(
        0.05, ge=0, description="an expert is dead on a step where its load is below this "
        "multiple of the mean load (1 = balanced)")
    dead_steps: int = Field(
        50, ge=1, description="warn when an expert has been dead this many steps in a row")


@register("hook", "routing", config=RoutingConfig)
class RoutingHook(Hook):
    """MoE routing health: expert loads to experts.jsonl, dead experts warned about. It runs
    before the log hook, which logs the figures it adds to the step's metrics."""

    priority = 80  # its figures join the log line

    def __init__(self, cfg: RoutingConfig) -> None:
        self.cfg = cfg
        self.health: RoutingHealth | None = None
        self.warned: set[tuple[int, int]] = set()

    def on_train_start(self, trainer) -> None:
        layers = moe_layers(trainer.model)
        self.health = RoutingHealth(layers, self.cfg.dead_below) if layers else None

    def on_step_end(self, trainer, result) -> None:
        if self.health is None:
            return
        if not result.skipped:  # a skipped step left the loads as they were
            self.health.update()
        step = trainer.progress.step
        if step % trainer.recipe.run.log_interval and step != trainer.total_steps:
            return
        snap = self.health.snapshot(step)
        result.metrics.update(self.figures(snap))
        if trainer.world.is_main:
            self.write(trainer, snap)
            for line in self.warnings(snap):
                trainer.print(line)

    def figures(self, snap: RoutingSnapshot) -> dict[str, float]:
        out, total = {}, 0
        for idx, bias, dead, drift in zip(snap.layer_ids, snap.bias, snap.dead_steps,
                                          snap.bias_drift, strict=True):
            n_dead = sum(d >= self.cfg.dead_steps for d in dead)
            total += n_dead
            out[f"moe/layer{idx}/dead"] = float(n_dead)
            out[f"moe/layer{idx}/bias_range"] = max(bias) - min(bias)
            out[f"moe/layer{idx}/bias_drift"] = drift
        out["moe/dead_experts"] = float(total)
        return out

    def write(self, trainer, snap: RoutingSnapshot) -> None:
        layers = [str(i) for i in snap.layer_ids]
        line = {"step": snap.step, "load": dict(zip(layers, snap.load, strict=True)),
                "bias": dict(zip(layers, snap.bias, strict=True)),
                "dead_steps": dict(zip(layers, snap.dead_steps, strict=True))}
        trainer.run_dir.mkdir(parents=True, exist_ok=True)
        with (trainer.run_dir / EXPERTS_FILE).open("a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    def warnings(self, snap: RoutingSnapshot) -> list[str]:
        lines = []
        for idx, dead, load in zip(snap.layer_ids, snap.dead_steps, snap.load, strict=True):
            for e, steps in enumerate(dead):
                key = (idx, e)
                if steps >= self.cfg.dead_steps and key not in self.warned:
                    self.warned.add(key)
                    lines.append(
                        f"warning: MoE layer {idx} expert {e} is dead: its load has been below "
                        f"{self.cfg.dead_below:g}x the mean for {steps} steps (now "
                        f"{load[e]:.2%} of the tokens); see the balancing bias "
                        f"(moe/layer{idx}/bias_range) or model.ffn.bias_update_coeff")
                elif steps == 0:
                    self.warned.discard(key)
        return lines

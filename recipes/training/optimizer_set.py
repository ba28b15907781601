"""All of a run's optimizers and their schedules, stepped together."""

from __future__ import annotations

import torch
from torch import nn

from kiln.components.optimizers.routing import param_groups, route, routing_table
from kiln.components.protocols import ModelContract


class OptimizerSet:
    """Routes parameters to the recipe's optimizers; sets LRs from each one's schedule."""

    def __init__(self, model: nn.Module, tables: dict, total_steps: int):
        self.tables = tables
        self.routes = route(model, tables)
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.schedules = {}
        # µP: the model's per-parameter LR factors (components/models/mup.py), applied by the
        # optimizers whose rule is to scale them (OptimizerConfig.mup_rule)
        multipliers = model.lr_multipliers() if isinstance(model, ModelContract) else {}
        self.mup_line = ""
        if multipliers:
            m = model.width_multiplier()
            scaled = [n for n, t in tables.items() if t.mup_rule == "scale"
                      and self.routes[n].numel]
            self.mup_line = (f"µP: width multiplier {m:g}; {len(multipliers)} hidden tensors at "
                             f"lr / {m:g} in {', '.join(scaled) or 'no optimizer'}")
        for name, cfg in tables.items():
            if multipliers and self.routes[name].numel:
                cfg.check_mup(name)
            scaled = multipliers if cfg.mup_rule == "scale" else {}
            groups = param_groups(self.routes[name], cfg, scaled)
            if not groups:
                continue  # an optimizer whose rule selected nothing (e.g. no scalar params)
            self.optimizers[name] = cfg.build(groups)
            self.schedules[name] = cfg.schedule.build(total_steps=total_steps)
        jacobians = getattr(model, "value_jacobians", None)  # reparameterised parameters
        if jacobians is not None:
            found = jacobians()
            for opt in self.optimizers.values():
                if hasattr(opt, "set_value_jacobians"):
                    opt.set_value_jacobians(found)

    def table(self) -> str:
        table = routing_table(self.routes, self.tables)
        return f"{table}\n{self.mup_line}" if self.mup_line else table

    def set_lr(self, step: int) -> None:
        for name, opt in self.optimizers.items():
            factor = self.schedules[name](step)
            for group in opt.param_groups:
                group["lr"] = group["peak_lr"] * factor

    def zero_grad(self) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=True)

    def step(self, last_segment: bool = True) -> None:
        for name, opt in self.optimizers.items():
            if last_segment or self.tables[name].step_every == "segment":
                opt.step()

    def lrs(self) -> dict[str, float]:
        return {
            g.get("name", name): float(g["lr"])
            for name, opt in self.optimizers.items()
            for g in opt.param_groups
        }

"""Routing parameters to optimizers: every trainable parameter lands in exactly one of them."""

from __future__ import annotations

from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from torch import nn

from kiln.components.distributed import is_dtensor
from kiln.components.errors import RecipeError
from kiln.components.optimizers.common import OptimizerConfig, ParamRule


@dataclass
class Route:
    """The parameters one optimizer trains, split into decayed and non-decayed groups."""

    name: str
    decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    no_decay: list[tuple[str, nn.Parameter]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.decay + self.no_decay)


def _owners(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Parameter name -> class names of its owning module and the module's base classes (so a
    rule naming ``Linear`` still matches after fp8 conversion or FSDP2 wrapping)."""
    owners = {}
    for mod_name, module in model.named_modules():
        classes = tuple(c.__name__ for c in type(module).__mro__)
        for p_name, _ in module.named_parameters(recurse=False):
            owners[f"{mod_name}.{p_name}" if mod_name else p_name] = classes
    return owners


def matches(
    rule: ParamRule, name: str, param: nn.Parameter, owner: str | tuple[str, ...]
) -> bool:
    if rule.ndim and param.ndim not in rule.ndim:
        return False
    if rule.include and not any(fnmatchcase(name, pat) for pat in rule.include):
        return False
    if any(fnmatchcase(name, pat) for pat in rule.exclude):
        return False
    classes = (owner,) if isinstance(owner, str) else owner
    if rule.modules and not any(c in rule.modules for c in classes):
        return False
    return not any(c in rule.exclude_modules for c in classes)


def route(model: nn.Module, tables: dict[str, OptimizerConfig]) -> dict[str, Route]:
    """Assign each trainable parameter to one optimizer table; error on gaps and overlaps."""
    owners = _owners(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    chosen: dict[str, list[str]] = {n: [] for n, _ in params}
    rest = [name for name, cfg in tables.items() if cfg.params.rest]
    if len(rest) > 1:
        raise RecipeError(
            f"optimizers {rest} all set params.rest = true; only one may take the rest"
        )
    for opt_name, cfg in tables.items():
        if cfg.params.rest:
            continue
        for n, p in params:
            if matches(cfg.params, n, p, owners.get(n, "")):
                chosen[n].append(opt_name)
    if rest:
        for n in chosen:
            if not chosen[n]:
                chosen[n].append(rest[0])
    doubly = {n: o for n, o in chosen.items() if len(o) > 1}
    if doubly:
        lines = [f"  {n}: {', '.join(o)}" for n, o in list(doubly.items())[:20]]
        raise RecipeError("parameters routed to more than one optimizer:\n" + "\n".join(lines))
    unrouted = [n for n, o in chosen.items() if not o]
    if unrouted:
        raise RecipeError(
            "parameters routed to no optimizer (add a rule or set params.rest = true on one "
            "optimizer): " + ", ".join(unrouted[:20]) + (" ..." if len(unrouted) > 20 else "")
        )
    routes = {name: Route(name) for name in tables}
    for n, p in params:
        opt_name = chosen[n][0]
        exempt = any(matches(rule, n, p, owners.get(n, "")) for rule in tables[opt_name].no_decay)
        (routes[opt_name].no_decay if exempt else routes[opt_name].decay).append((n, p))
    for opt_name, r in routes.items():  # optimizers that accept only some parameters say so
        check = getattr(tables[opt_name], "check_params", None)
        if check is not None:
            check(opt_name, r.decay + r.no_decay)
    return routes


def _by_mesh(members: list[tuple[str, nn.Parameter]]) -> list[list[nn.Parameter]]:
    """Members split by device mesh (plain tensors together), in first-seen order.

    torch's foreach/fused optimizer kernels take one group's tensors in one call, and DTensor
    refuses a call mixing plain tensors with DTensors or DTensors of different meshes (tensor
    parallel leaves some parameters whole: see ``kiln.parallelisms.tensor_parallel``).
    """
    parts: dict[object, list[nn.Parameter]] = {}
    for _, p in members:
        key = p.device_mesh if is_dtensor(p) else None
        parts.setdefault(key, []).append(p)
    return list(parts.values())


def param_groups(route_: Route, cfg: OptimizerConfig,
                 multipliers: dict[str, float] | None = None) -> list[dict]:
    """torch param groups for one optimizer: decayed and non-decayed, each with its peak LR
    (each split by device mesh when parallelism makes the parameters differ in kind).
    ``multipliers`` (parameter name -> LR factor: µP's hidden matrices) puts the parameters
    with a factor in groups of their own, named ``NAME/mup`` (``NAME/mup/no_decay``)."""
    multipliers = multipliers or {}
    groups = []
    for suffix, members, wd in (
        ("", route_.decay, cfg.weight_decay), ("no_decay", route_.no_decay, 0.0)
    ):
        by_factor: dict[float, list[tuple[str, nn.Parameter]]] = {}
        for n, p in members:
            by_factor.setdefault(multipliers.get(n, 1.0), []).append((n, p))
        for factor, part in by_factor.items():
            tag = "/".join(t for t in ("mup" if factor != 1.0 else "", suffix) if t)
            for params in _by_mesh(part):
                groups.append({
                    "params": params,
                    "lr": cfg.lr * factor,
                    "peak_lr": cfg.lr * factor,
                    "weight_decay": wd,
                    "name": f"{route_.name}/{tag}" if tag else route_.name,
                })
    return groups


def routing_table(routes: dict[str, Route], tables: dict[str, OptimizerConfig]) -> str:
    """A printable table: optimizer, type, tensors, elements, peak LR, decayed / exempt."""
    rows = [("optimizer", "type", "tensors", "params", "peak_lr", "decay/no_decay tensors")]
    for name, r in routes.items():
        cfg = tables[name]
        rows.append((
            name, cfg.type, str(len(r.decay) + len(r.no_decay)), f"{r.numel:,}",
            f"{cfg.lr:g}", f"{len(r.decay)}/{len(r.no_decay)}",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )

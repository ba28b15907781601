"""Module diagnostics (``[run.diagnostics]``): every ``interval`` steps, per block the RMS and
largest magnitude of the residual stream it writes, per attention layer the largest logit and
the mean entropy of its attention rows, per MoE layer the router's per-token entropy, per layer
and per optimizer parameter group the gradient norm and the update-to-weight ratio; for looped
cores every figure of a recurrent block per loop iteration, the state after each loop (RMS, max,
the norm of the loss gradient flowing into it) and the carry's RMS.

Cost: the module hooks are registered just before a diagnostic step and removed after it, so the
other steps run exactly the code they run without diagnostics. Hooks only read (under no_grad),
so the losses are bit-identical with and without them. Figures are of the full tensors over all
ranks: sums of squares and counts are summed, maxima maxed, in two all-reduces per diagnostic
step (``kiln.components.distributed``); parameter and gradient norms go through
``parallelisms.grads.full_sum_squares`` (DTensor shards of any layout counted once).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
from pydantic import Field

from kiln.components import distributed
from kiln.components.attention.logit_stats import attention_logit_stats
from kiln.components.base import ComponentConfig
from kiln.components.errors import RecipeError
from kiln.components.ffn.moe import moe_layers
from kiln.components.ffn.moe_health import router_entropy
from kiln.components.protocols import Hook
from kiln.components.registry import register
from kiln.parallelisms.blocks import clean_name
from kiln.parallelisms.grads import full_sum_squares

HISTOGRAM_VALUES = 65536  # sampled values per histogram (of rank 0's first micro-batch)


def _in_backward() -> bool:
    """Activation checkpointing re-runs block forwards inside backward: not a second forward."""
    return torch._C._current_graph_task_id() != -1


def layer_key(name: str) -> str:
    """``layers.3.attention.wq.weight`` -> ``layer3``; ``tok_embeddings.weight`` ->
    ``tok_embeddings``."""
    parts = clean_name(name).split(".")
    return f"layer{parts[1]}" if parts[0] == "layers" and len(parts) > 2 else parts[0]


class Collector:
    """Per-key sums (reduced by sum over ranks) and maxima (reduced by max), on the device."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.maxes: dict[str, torch.Tensor] = {}

    def add(self, key: str, sums: torch.Tensor, top: torch.Tensor | None = None) -> None:
        sums = sums.detach().float()
        self.sums[key] = self.sums[key] + sums if key in self.sums else sums.clone()
        if top is not None:
            top = top.detach().float()
            self.maxes[key] = torch.maximum(self.maxes[key], top) if key in self.maxes else top

    def reduce(self, device: torch.device) -> tuple[dict[str, list[float]], dict[str, float]]:
        """Everything over all ranks; the one host transfer of a diagnostic step."""
        skeys, mkeys = sorted(self.sums), sorted(self.maxes)
        sizes = [self.sums[k].numel() for k in skeys]
        flat = torch.cat([self.sums[k].reshape(-1).to(device) for k in skeys]) if skeys else \
            torch.zeros(0, device=device)
        tops = torch.stack([self.maxes[k].to(device) for k in mkeys]) if mkeys else \
            torch.zeros(0, device=device)
        distributed.all_reduce_(flat)
        distributed.all_reduce_(tops, op="max")
        values = flat.tolist()
        sums, at = {}, 0
        for key, n in zip(skeys, sizes, strict=True):
            sums[key], at = values[at:at + n], at + n
        return sums, dict(zip(mkeys, tops.tolist(), strict=True))


def _moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([sum of squares, count], max |x|) of a tensor, fp32."""
    x = x.detach().float()
    return torch.stack([x.pow(2).sum(), torch.tensor(float(x.numel()), device=x.device)]), \
        x.abs().amax()


class DiagnosticsConfig(ComponentConfig):
    """Per-module figures every ``interval`` steps (``[run.diagnostics]``: the table turns them
    on; without it no hook is registered and nothing is computed)."""

    interval: int = Field(100, ge=1, description="collect on every N-th step")
    attention: bool = Field(
        True, description="attention logit max and entropy per layer (recomputes q.k of every "
        "attention layer on a diagnostic step)")
    attention_rows: int = Field(
        64, ge=0, description="query positions per sequence the attention figures read (evenly "
        "spaced, ending at the last; 0 = all T: exact, but the recompute grows with T^2)")
    histograms: bool = Field(
        True, description="TensorBoard histograms of each block's output (a sample of rank 0's "
        "values) beside the scalars")


@register("hook", "diagnostics", config=DiagnosticsConfig)
class DiagnosticsHook(Hook):
    """Per-module activation, attention, gradient and update figures every interval steps."""

    priority = 40  # arms its module hooks after the evaluations ran

    def __init__(self, cfg: DiagnosticsConfig) -> None:
        self.cfg = cfg
        self.handles: list = []
        self.armed = False
        self.pending: list[tuple[str, torch.Tensor, torch.Tensor | None]] = []
        self.samples: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------------- set-up
    def on_train_start(self, trainer) -> None:
        if trainer.mesh_layout.pp > 1:  # each rank holds other layers: the sums would mismatch
            raise RecipeError(f"[run.diagnostics] with parallelism.pp = {trainer.mesh_layout.pp} "
                              "is not supported yet: each pipeline rank holds other layers; "
                              "remove the table or train with pp = 1")
        model = trainer.model
        self.model = model
        recurrent = set(getattr(model, "recurrent_ids", []))
        self.blocks = [(str(i), b, str(i) in recurrent) for i, b in enumerate(model.blocks())]
        self.moes = moe_layers(model)
        params = {id(p): (n, p) for n, p in model.named_parameters() if p.requires_grad}
        by_layer: dict[str, list] = defaultdict(list)
        for name, p in params.values():
            by_layer[layer_key(name)].append(p)
        self.layers = dict(by_layer)
        self.groups = {}
        for opt_name, opt in trainer.optimizers.optimizers.items():
            for group in opt.param_groups:
                self.groups[group.get("name", opt_name)] = list(group["params"])
        self.maybe_arm(trainer)

    def maybe_arm(self, trainer) -> None:
        step = trainer.progress.step + 1  # the step about to run, as it will be logged
        if step % self.cfg.interval or step > trainer.total_steps:
            return
        self.collector = Collector()
        self.pending, self.samples = [], {}
        self.before = {k: [p.detach().clone() for p in ps] for k, ps in self.layers.items()}
        for key, block, looped in self.blocks:
            self.handles.append(block.register_forward_hook(self._block_hook(key, looped)))
            if not self.cfg.attention:
                continue
            for module in block.modules():
                if hasattr(module, "score_inputs"):
                    self.handles.append(module.register_forward_hook(
                        self._attention_hook(key, looped), with_kwargs=True))
        for layer in self.moes:
            self.handles.append(layer.register_forward_hook(self._router_hook(layer)))
        if hasattr(self.model, "loop_observer"):
            self.model.loop_observer = self._on_loop
        self.armed = True

    def disarm(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []
        if hasattr(self, "model") and hasattr(self.model, "loop_observer"):
            self.model.loop_observer = None
        self.armed = False

    # ------------------------------------------------------------------------- hooks
    def _live(self) -> bool:
        return self.model.training and not _in_backward()

    def _record(self, key: str, looped: bool, sums: torch.Tensor, top: torch.Tensor) -> None:
        if looped:  # a recurrent block: its loop is known when the loop ends (_on_loop)
            self.pending.append((key, sums, top))
        else:
            self.collector.add(key, sums, top)

    def _block_hook(self, key: str, looped: bool):
        def hook(module, args, output) -> None:
            if not self._live():
                return
            out = output[0] if isinstance(output, tuple) else output
            sums, top = _moments(distributed.local_tensor(out))
            self._record(f"act/layer{key}", looped, sums, top)
            if self.cfg.histograms and key not in self.samples:
                self.samples[key] = distributed.local_tensor(out).detach().reshape(-1)[
                    :HISTOGRAM_VALUES].float().cpu()
        return hook

    def _attention_hook(self, key: str, looped: bool):
        def hook(module, args, kwargs, output) -> None:
            # With an attention context (document mask, context parallel) the map is not the
            # plain causal one score_inputs describes: no attention figures then.
            if not self._live() or kwargs.get("context") is not None:
                return
            stats = attention_logit_stats(module, args[0], self.cfg.attention_rows)
            if stats is not None:
                self._record(f"attn/layer{key}", looped, stats[1:], stats[0])
        return hook

    def _router_hook(self, layer):
        def hook(module, args, output) -> None:
            if self._live():
                self.collector.add(f"router/layer{layer.layer_idx}",
                                   router_entropy(layer, distributed.local_tensor(args[0])))
        return hook

    def _on_loop(self, i: int, state: torch.Tensor) -> None:
        if not self.model.training:
            return
        for key, sums, top in self.pending:
            kind, _, layer = key.partition("/")
            self.collector.add(f"{kind}/{layer}/loop{i}", sums, top)
        self.pending = []
        sums, top = _moments(distributed.local_tensor(state))
        self.collector.add(f"state/loop{i}", sums, top)
        if state.requires_grad:
            state.register_hook(self._state_grad_hook(i))

    def _state_grad_hook(self, i: int):
        def hook(grad: torch.Tensor) -> None:
            sums, _ = _moments(distributed.local_tensor(grad))
            self.collector.add(f"state_grad/loop{i}", sums)
        return hook

    # --------------------------------------------------------------------- the figures
    def on_step_end(self, trainer, result) -> None:
        if self.armed:
            self.disarm()
            values = self.figures(trainer, result)
            step = trainer.progress.step
            trainer.metrics.log(step, values)
            for key, sample in self.samples.items():
                trainer.metrics.histogram(step, f"diag/act/layer{key}", sample)
            trainer.print(summary_line(step, values))
        self.maybe_arm(trainer)

    def figures(self, trainer, result) -> dict[str, float]:
        carry = self.model.carry_state()
        for key, t in (carry or {}).items():
            if key.startswith("state."):
                self.collector.add("carry", _moments(t)[0])
        sums, maxes = self.collector.reduce(trainer.device)
        out: dict[str, float] = {}
        dp = trainer.data_ranks  # the global loss is the mean of the data-parallel ranks' losses
        for key, s in sums.items():
            kind, _, rest = key.partition("/")
            prefix = f"diag/{kind}" + (f"/{rest}" if rest else "")
            if kind in ("act", "state", "carry"):
                out[f"{prefix}/rms"] = math.sqrt(s[0] / max(s[1], 1))
                if key in maxes:
                    out[f"{prefix}/max"] = maxes[key]
            elif kind == "attn":
                out[f"{prefix}/logit_max"] = maxes[key]
                out[f"{prefix}/entropy"] = s[0] / max(s[1], 1)
            elif kind == "router":
                out[f"{prefix}/entropy"] = s[0] / max(s[1], 1)
            elif kind == "state_grad":
                out[f"{prefix}/norm"] = math.sqrt(s[0]) / dp
        out.update(self._param_figures(trainer, result))
        return out

    def _param_figures(self, trainer, result) -> dict[str, float]:
        """Gradient norms (before clipping, as the logged grad_norm) and update-to-weight ratios
        per layer and per optimizer parameter group."""
        names = [*self.layers, *self.groups]
        owners = [*self.layers.values(), *self.groups.values()]
        layer_of = {id(p): k for k, ps in self.layers.items() for p in ps}
        before = {id(p): b for k, ps in self.layers.items()
                  for p, b in zip(ps, self.before[k], strict=True)}
        grads = [[p.grad for p in ps if p.grad is not None] for ps in owners]
        weights = [[before[id(p)] for p in ps if id(p) in layer_of] for ps in owners]
        updates = [[p.detach() - before[id(p)] for p in ps if id(p) in layer_of] for ps in owners]
        dev = trainer.device
        g2, w2, u2 = (full_sum_squares(x, dev).tolist() for x in (grads, weights, updates))
        self.before = {}
        clip, norm = trainer.recipe.training.grad_clip, result.grad_norm
        unclip = max(1.0, norm / clip) if clip and norm is not None and math.isfinite(norm) else 1
        out = {}
        for i, name in enumerate(names):
            where = f"layer/{name}" if i < len(self.layers) else f"group/{name}"
            if grads[i]:
                out[f"diag/grad/{where}/norm"] = math.sqrt(g2[i]) * unclip
            if w2[i] > 0:
                out[f"diag/update/{where}/ratio"] = math.sqrt(u2[i] / w2[i])
        return out

    def close(self, trainer) -> None:
        self.disarm()


def summary_line(step: int, values: dict[str, float]) -> str:
    """One console line: the extremes over layers (and loops) of the main figures."""
    def pick(prefix: str, suffix: str, fn) -> str:
        found = [v for k, v in values.items() if k.startswith(prefix) and k.endswith(suffix)]
        return f"{fn(found):.4g}" if found else "-"

    return (f"diag  step {step}  act rms max {pick('diag/act/', '/rms', max)}  "
            f"act max {pick('diag/act/', '/max', max)}  "
            f"attn logit max {pick('diag/attn/', '/logit_max', max)}  "
            f"attn entropy min {pick('diag/attn/', '/entropy', min)}  "
            f"grad norm max {pick('diag/grad/layer/', '/norm', max)}  "
            f"update/weight max {pick('diag/update/layer/', '/ratio', max)}")

"""What every adapter that hangs off linear layers shares: its recipe fields, matching the target
layers, freezing the model, the forward hook, merging and the ``peft`` fields of a low-rank
update. ``lora.py`` and ``dora.py`` each add their ``AdapterLayer`` and ``peft`` type.

Each target ``nn.Linear`` gets a child (``lora``, ``dora``) and one forward hook (``_adapt``)
that hands the layer's output to it. The base weights keep their names, so a pretrained
checkpoint, ``init_from`` and the Hugging Face export read them as before, and FSDP2,
activation checkpointing and ``torch.compile`` see ordinary modules.
"""

from __future__ import annotations

import fnmatch
import math
import re
from typing import Any

import torch
from pydantic import Field
from torch import nn

from kiln.components.adapter_contract import AdapterContract, AdapterLayer, adapter_layers
from kiln.components.base import ComponentConfig
from kiln.components.errors import RecipeError

# Every linear layer of the attention: wq, wk, wv and wo, or a fused wqkv and wo (Nova).
DEFAULT_TARGETS = ["*.attention.*"]


class LowRankConfig(ComponentConfig):
    """Rank, scale, dropout and target layers of low-rank adapters."""

    rank: int = Field(8, ge=1, description="rank r of each update B @ A")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    targets: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        description="globs over module names (as in the model's state dict, e.g. "
        '"*.attention.wq", "*.feed_forward.*"); every matching nn.Linear gets an adapter, and '
        'every glob must match at least one')
    allow_random_base: bool = Field(
        False, description="train adapters without checkpoint.init_from, on the model's "
        "random initialisation (tests, ablations); otherwise such a run is refused")


class LowRankLayer(AdapterLayer):
    """``A`` (rank, in) and ``B`` (out, rank), the update scaled by ``alpha / rank``, dropout on
    the input: what LoRA's and DoRA's layers share. ``A`` starts as peft's does
    (Kaiming-uniform, a = sqrt(5)) and ``B`` at zero, so training starts from the base model.
    A subclass adds its own parameters, then calls ``init_on_device(base)``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        dev, dtype = base.weight.device, base.weight.dtype
        self.A = nn.Parameter(torch.empty(rank, base.in_features, device=dev, dtype=dtype))
        self.B = nn.Parameter(torch.zeros(base.out_features, rank, device=dev, dtype=dtype))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()

    def init_on_device(self, base: nn.Linear) -> None:
        if base.weight.device.type != "meta":  # else meta init calls reset_adapter later
            self.reset_adapter(base)

    @torch.no_grad()
    def reset_adapter(self, base: nn.Linear) -> None:
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        nn.init.zeros_(self.B)


def _adapt(module: nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor:
    """The forward hook of an adapted layer: its adapter child adapts the output."""
    for child in module.children():
        if isinstance(child, AdapterLayer) and child.enabled:
            out = child.adapt(module, args[0], out)
    return out


class Disabled:
    """``with`` it, the layers' adapters add nothing; reusable (a step enters it every step)."""

    def __init__(self, layers: list[AdapterLayer]) -> None:
        self.layers = layers

    def __enter__(self) -> None:
        for layer in self.layers:
            layer.enabled = False

    def __exit__(self, *exc: object) -> None:
        for layer in self.layers:
            layer.enabled = True


class LinearAdapter(AdapterContract):
    """An adapter type whose ``layer(base, cfg)`` is added to every target linear layer as the
    child ``child``; subclasses name both and their ``peft`` type."""

    child = ""  # the attribute name on the adapted layer: a part of every adapter tensor's name
    peft_type = "LORA"

    def __init__(self, cfg: LowRankConfig, **context: object) -> None:
        self.cfg = cfg

    def layer(self, base: nn.Linear) -> AdapterLayer:
        raise NotImplementedError

    def targets(self, model: nn.Module) -> list[str]:
        """Names of the linear layers the globs match: an error names every glob that matches
        none, and a layer whose weight another module shares (tied embeddings)."""
        linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        idle = [g for g in self.cfg.targets if not any(fnmatch.fnmatchcase(n, g) for n in linear)]
        if idle:
            kinds = sorted(set(re.sub(r"\.\d+\.", ".N.", n) for n in linear))  # per block
            raise RecipeError(
                f"adapter.targets: {', '.join(repr(g) for g in idle)} "
                f"match{'es' if len(idle) == 1 else ''} no linear layer; the model's are "
                f"{', '.join(kinds)} (N: the block)")
        hits = [n for n in linear if any(fnmatch.fnmatchcase(n, g) for g in self.cfg.targets)]
        owners: dict[int, list[str]] = {}
        for name, module in model.named_modules(remove_duplicate=False):
            for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
                owners.setdefault(id(p), []).append(f"{name}.{pname}")
        for name in hits:
            shared = owners[id(model.get_submodule(name).weight)]
            if len(shared) > 1:
                raise RecipeError(
                    f"adapter.targets: {name} shares its weight with "
                    f"{', '.join(n for n in shared if n != f'{name}.weight')} (tied "
                    "embeddings), so merging its adapter would change both; leave it out of "
                    "the targets or train with model.tie_embeddings = false")
        return hits

    def check_base(self, init_from: str) -> None:
        """Adapters are trained on a pretrained base: without ``init_from`` the base is random
        and a PEFT export names none, so that needs ``allow_random_base``."""
        if not init_from and not self.cfg.allow_random_base:
            raise RecipeError(
                "[adapter] without checkpoint.init_from trains adapters on a randomly "
                "initialised frozen model; name the pretrained base in checkpoint.init_from "
                "(a kiln checkpoint or a Hugging Face folder), or set "
                "adapter.allow_random_base = true if that is what you want")

    def apply(self, model: nn.Module) -> str:
        hits = self.targets(model)
        for p in model.parameters():
            p.requires_grad_(False)
        for name in hits:
            layer = model.get_submodule(name)
            setattr(layer, self.child, self.layer(layer))
            layer.register_forward_hook(_adapt)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        return (f"adapter: {self.cfg.type} rank {self.cfg.rank}, alpha {self.cfg.alpha:g} on "
                f"{len(hits)} layers; {trainable:,} trainable of {total:,} parameters "
                f"({trainable / total:.2%}), the rest frozen")

    def owns(self, name: str) -> bool:
        return f".{self.child}." in name

    def on_base_loaded(self, model: nn.Module) -> None:
        for base, _, layer in adapter_layers(model).values():
            layer.on_base_loaded(base)

    def disabled(self, model: nn.Module) -> Disabled:
        return Disabled([layer for _, _, layer in adapter_layers(model).values()])

    def merge(self, model: nn.Module) -> int:
        merged = 0
        for base, child, layer in adapter_layers(model).values():
            with torch.no_grad():
                base.weight.copy_(layer.merged_weight(base).to(base.weight.dtype))
            delattr(base, child)
            if not any(isinstance(c, AdapterLayer) for c in base.children()):
                for key, hook in list(base._forward_hooks.items()):
                    if hook is _adapt:
                        del base._forward_hooks[key]
            merged += 1
        return merged

    def peft_config(self) -> dict[str, Any]:
        c = self.cfg
        return {"peft_type": self.peft_type, "r": c.rank, "lora_alpha": c.alpha,
                "lora_dropout": c.dropout, "use_dora": False}

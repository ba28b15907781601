"""LoRA: a low-rank update ``B @ A`` (scaled by ``alpha / rank``) added to chosen linear layers
of a frozen model (Hu et al., 2021), as ``peft``'s ``LoraLayer`` computes it.

The adapter does not replace the layers: each target ``nn.Linear`` gets a child ``lora``
(parameters ``A`` (rank, in) and ``B`` (out, rank)) and a forward hook adding
``lora(x)`` to its output. The base weights keep their names, so a pretrained checkpoint,
``init_from`` and the Hugging Face export read them as before, and FSDP2, activation
checkpointing and ``torch.compile`` see ordinary modules. Every base parameter is frozen
(``requires_grad = False``), so the optimizers never hold it. ``A`` starts as peft's does
(Kaiming-uniform, a = sqrt(5)) and ``B`` at zero: training starts from the base model exactly.
"""

from __future__ import annotations

import fnmatch
import math
import re

import torch
from pydantic import Field
from torch import nn

from kiln.components.base import ComponentConfig
from kiln.components.errors import RecipeError
from kiln.components.registry import register


def is_adapter(name: str) -> bool:
    """A parameter or state-dict name of an adapter (``layers.0.attention.wq.lora.A``)."""
    return ".lora." in name


# Every linear layer of the attention: wq, wk, wv and wo, or a fused wqkv and wo (Nova).
DEFAULT_TARGETS = ["*.attention.*"]


class LoRAConfig(ComponentConfig):
    """Rank, scale, dropout and target layers of the low-rank adapters."""

    rank: int = Field(8, ge=1, description="rank r of each update B @ A")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    targets: list[str] = Field(
        default_factory=lambda: list(DEFAULT_TARGETS),
        description="globs over module names (as in the model's state dict, e.g. "
        '"*.attention.wq", "*.ffn.*"); every matching nn.Linear gets an adapter, and '
        'every glob must match at least one')
    allow_random_base: bool = Field(
        False, description="train adapters without checkpoint.init_from, on the model's "
        "random initialisation (tests, ablations); otherwise such a run is refused")


class LoRAPair(nn.Module):
    """``A`` (rank, in) and ``B`` (out, rank): ``forward(x) = dropout(x) @ A.T @ B.T * scale``."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float) -> None:
        super().__init__()
        dev, dtype = base.weight.device, base.weight.dtype
        self.A = nn.Parameter(torch.empty(rank, base.in_features, device=dev, dtype=dtype))
        self.B = nn.Parameter(torch.zeros(base.out_features, rank, device=dev, dtype=dtype))
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout else nn.Identity()
        if dev.type != "meta":  # else meta-device init calls reset_adapter after the model's
            self.reset_adapter()

    def reset_adapter(self) -> None:
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))
        nn.init.zeros_(self.B)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.dropout(x) @ self.A.t() @ self.B.t()) * self.scale

    def extend_head(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """On the output layer, for the chunked loss (``lm_head.HeadExtension``): ``(scale *
        dropout(x) @ A.T, B)``, (..., rank) and (V, rank), whose product is this update."""
        return (self.dropout(x) @ self.A.t()) * self.scale, self.B

    def delta(self) -> torch.Tensor:
        """The update of the base weight: ``scale * B @ A`` (out, in)."""
        return (self.B @ self.A) * self.scale


def _add_update(module: nn.Linear, args: tuple, out: torch.Tensor) -> torch.Tensor:
    pair = module.lora
    down = pair.dropout(args[0]) @ pair.A.t()  # (..., rank)
    # One addmm: out + scale * down @ B.T without a separate product and sum over (N, out).
    flat = torch.addmm(out.reshape(-1, out.shape[-1]), down.reshape(-1, down.shape[-1]),
                       pair.B.t(), alpha=pair.scale)
    return flat.view(out.shape)


@register("adapter", "lora")
class LoRA:
    """Low-rank adapters on the target linear layers; everything else frozen."""

    Config = LoRAConfig

    def __init__(self, cfg: LoRAConfig, **context: object) -> None:
        self.cfg = cfg

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
        """Freeze ``model`` and add the adapters; a line for the start-up log."""
        hits = self.targets(model)
        for p in model.parameters():
            p.requires_grad_(False)
        for name in hits:
            layer = model.get_submodule(name)
            c = self.cfg
            layer.lora = LoRAPair(layer, c.rank, c.alpha, c.dropout)
            layer.register_forward_hook(_add_update)
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        return (f"adapter: lora rank {self.cfg.rank}, alpha {self.cfg.alpha:g} on {len(hits)} "
                f"layers; {trainable:,} trainable of {total:,} parameters "
                f"({trainable / total:.2%}), the rest frozen")


def merge(model: nn.Module) -> int:
    """Fold every adapter into its base weight (``W += scale * B @ A``) and remove it: the model
    then computes the same function without adapters. Returns the layers merged."""
    merged = 0
    for module in list(model.modules()):
        pair = getattr(module, "lora", None)
        if isinstance(module, nn.Linear) and isinstance(pair, LoRAPair):
            with torch.no_grad():
                module.weight += pair.delta().to(module.weight.dtype)
            del module.lora
            for key, hook in list(module._forward_hooks.items()):
                if hook is _add_update:
                    del module._forward_hooks[key]
            merged += 1
    return merged

"""The adapters' contract, written as code (as ``protocols.py`` writes the trainer's).

- ``AdapterLayer``: what an adapter adds to one linear layer;
- ``AdapterContract``: what an adapter type offers the trainer, the checkpoints and the
  exports (apply, the parameters it owns, merge, its ``peft`` description), so no caller
  imports one adapter's helpers;
- ``adapter_layers`` / ``adapter_parameter_names``: a model's adapted layers and their names.

A leaf module: it imports only torch, so any floor may use it.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn


class AdapterLayer(nn.Module):
    """What an adapter adds to one ``nn.Linear``: a child module of that layer, whose output a
    forward hook adapts (``adapt``). The base layer keeps its weight and name, so pretrained
    checkpoints load as before; the layer is passed in where the adapter needs its weight (a
    child holding its parent would be a module cycle). ``enabled`` False: the layer computes
    its base alone (``AdapterContract.disabled``)."""

    enabled: bool = True

    def adapt(self, base: nn.Linear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The adapted output of ``base`` for input ``x``, whose own output is ``out``."""
        raise NotImplementedError

    def merged_weight(self, base: nn.Linear) -> torch.Tensor:
        """The weight with which ``base`` alone computes the adapted function."""
        raise NotImplementedError

    def extend_head(self, hidden: torch.Tensor, weight: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """On the output layer under the chunked loss (``lm_head.HeadExtension``): extra
        columns ``(h (..., r), w (V, r))`` whose product ``h @ w.T`` the adapter adds to
        ``hidden @ weight.T``."""
        raise NotImplementedError

    def reset_adapter(self, base: nn.Linear) -> None:
        """Initialise the adapter's parameters (also after a meta-device build)."""

    def on_base_loaded(self, base: nn.Linear) -> None:
        """The base weight was replaced (``checkpoint.init_from``) before training began:
        re-derive what depends on it."""

    def peft_tensors(self) -> dict[str, tuple[torch.Tensor, bool]]:
        """``peft``'s tensors of this layer by name suffix (``lora_A.weight``), each with
        whether its rows follow the base weight's output rows (a layout permutes those)."""
        raise NotImplementedError


def adapter_layers(model: nn.Module) -> dict[str, tuple[nn.Linear, str, AdapterLayer]]:
    """Each adapted layer's module name -> (the layer, its adapter's child name, the adapter),
    in module order."""
    return {name: (module, child_name, child) for name, module in model.named_modules()
            if isinstance(module, nn.Linear)
            for child_name, child in module.named_children() if isinstance(child, AdapterLayer)}


def adapter_parameter_names(model: nn.Module) -> set[str]:
    """State-dict names of every adapter tensor in ``model``: what exports leave out."""
    return {f"{name}.{child_name}.{key}"
            for name, (_, child_name, layer) in adapter_layers(model).items()
            for key in layer.state_dict()}


class AdapterContract:
    """What an adapter type (kind ``adapter``) offers: docs/design.md "Adapter protocol".

    The trainer, the checkpoints and the exports use these methods only, so a new adapter type
    is one module (``components/adapters/dora.py`` beside ``lora.py``).
    """

    def check_base(self, init_from: str) -> None:
        """Refuse a recipe whose base the adapter cannot train on (a RecipeError)."""

    def apply(self, model: nn.Module) -> str:
        """Freeze ``model`` and add the adapters; a line for the start-up log."""
        raise NotImplementedError

    def owns(self, name: str) -> bool:
        """Whether a parameter or state-dict name is one of the adapters' (what an
        adapters-only checkpoint saves)."""
        raise NotImplementedError

    def on_base_loaded(self, model: nn.Module) -> None:
        """After ``checkpoint.init_from`` replaced the base weights of a fresh run."""

    def disabled(self, model: nn.Module) -> AbstractContextManager:
        """Within it, ``model`` computes its frozen base's function (the adapters add nothing):
        the reference of a preference loss without a second copy of the weights."""
        raise NotImplementedError

    def merge(self, model: nn.Module) -> int:
        """Fold every adapter into its base weight and remove it: the model then computes the
        same function without adapters. Returns the layers merged."""
        raise NotImplementedError

    def peft_config(self) -> dict[str, Any]:
        """The fields of ``peft``'s ``adapter_config.json`` this adapter sets (``peft_type``,
        ``r``, ``use_dora``, ...); ``{}``: no ``peft`` form (``--format peft`` is refused)."""
        return {}

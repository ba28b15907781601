"""The µP coordinate check (Yang et al. 2022, appendix D.1): train a few steps at several
widths and watch the typical size of every layer's output coordinates.

Under µP, a layer's output coordinates, and how far they move from their initial values, stay
the same size as the width grows; under the standard parametrization with Adam, the updates
(the logits' first of all) grow with width. Here each width is the recipe resized by kiln
ladder's rule at fixed depth; it trains ``steps`` AdamW/Muon steps (the recipe's optimizers and
LR, without warmup) on random token batches (the check is about the parametrization, not the
data: the paper's own check uses any batch), and after every step a fixed probe batch measures
each layer's mean absolute output coordinate and its mean absolute change since step 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from kiln.components.models.block import padded_vocab
from kiln.recipes.config.files import load_recipe
from kiln.recipes.scaling.ladder import size_values
from kiln.recipes.training.optimizer_set import OptimizerSet


@dataclass
class Coords:
    """One parametrization's measurements: layer -> width -> per-step sizes."""

    parametrization: str
    widths: list[int]
    size: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # mean |h_t|
    change: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # mean |h_t - h_0|

    def growth(self, layer: str, what: str = "change") -> float:
        """The last step's value at the widest width over the narrowest's."""
        table = getattr(self, what)[layer]
        lo, hi = table[self.widths[0]][-1], table[self.widths[-1]][-1]
        return hi / lo if lo > 0 else float("inf")


def probed_modules(model: nn.Module) -> dict[str, nn.Module]:
    """What the check watches: the embedding, each block's attention, feed-forward and output,
    the final norm (the logits are the model's own output)."""
    out = {"embedding": model.tok_embeddings}
    for key, block in model.layers.items():
        out[f"layers.{key}.attention"] = block.attention
        out[f"layers.{key}.feed_forward"] = block.feed_forward
        out[f"layers.{key}"] = block
    out["norm"] = model.norm
    return out


def measure(recipe_path: str, overrides: list[str], widths: list[int], *, steps: int = 4,
            batch: int = 4, seq_len: int = 64, parametrization: str | None = None,
            seed: int = 0) -> Coords:
    """Train ``steps`` steps at every width; sizes per layer, width and step (0 = init)."""
    extra = [f"--model.parametrization={parametrization}"] if parametrization else []
    base = load_recipe(recipe_path, [*overrides, *extra])
    coords = Coords(base.model.parametrization, sorted(widths))
    vocab = padded_vocab(base.model, base.tokenizer.build().vocab_size)
    gen = torch.Generator().manual_seed(seed)
    batches = torch.randint(0, vocab, (steps + 1, batch, seq_len + 1), generator=gen)
    for width in coords.widths:
        sized = load_recipe(recipe_path, [*overrides, *extra, *(
            f"--{k}={v}" for k, v in size_values(base, width, "fixed"))])
        torch.manual_seed(seed)
        model = sized.model.build(vocab_size=vocab, seq_len=seq_len)
        opts = OptimizerSet(model, sized.optimizer_tables(), steps)
        for opt in opts.optimizers.values():  # the peak LR from the first step: no warmup
            for group in opt.param_groups:
                group["lr"] = group["peak_lr"]
        first: dict[str, torch.Tensor] = {}
        for step in range(steps + 1):
            outs = _probe(model, batches[0, :, :-1])
            for name, h in outs.items():
                first.setdefault(name, h)
                coords.size.setdefault(name, {}).setdefault(width, []).append(
                    h.abs().mean().item())
                coords.change.setdefault(name, {}).setdefault(width, []).append(
                    (h - first[name]).abs().mean().item())
            if step < steps:
                model.train()
                ids = batches[step + 1]
                logits = model(ids[:, :-1])
                F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
                opts.step()
                opts.zero_grad()
    return coords


@torch.no_grad()
def _probe(model: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.eval()
    outs: dict[str, torch.Tensor] = {}
    hooks = [module.register_forward_hook(
        lambda _m, _a, out, name=name: outs.__setitem__(name, out.detach().float()))
        for name, module in probed_modules(model).items()]
    try:
        outs["logits"] = model(ids).float()
    finally:
        for h in hooks:
            h.remove()
    return outs


def growing(coords: Coords, factor: float) -> list[tuple[str, float]]:
    """Layers whose update size grows by more than ``factor`` from the narrowest width to the
    widest (µP keeps it flat)."""
    return [(name, g) for name in coords.change if (g := coords.growth(name)) > factor]


def table(coords: list[Coords]) -> str:
    """Rows of layers; per parametrization and width the last step's mean |change| and the
    growth from the narrowest width to the widest."""
    widths = coords[0].widths
    head = ["layer"] + [f"{c.parametrization} d={w}" for c in coords for w in widths] + [
        f"{c.parametrization} growth" for c in coords]
    rows = [head]
    for name in coords[0].change:
        cells = [name] + [f"{c.change[name][w][-1]:.3g}" for c in coords for w in widths]
        rows.append(cells + [f"x{c.growth(name):.2f}" for c in coords])
    width = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) if i else cell.ljust(w)
                               for i, (cell, w) in enumerate(zip(r, width, strict=True)))
                     for r in rows)

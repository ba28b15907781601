"""``checkpoint.init_from`` in a training run: the weights a fresh run starts from (or, for an
adapters-only checkpoint, its frozen base read again on resume), with a note for every
``[model]`` key where the recipe is not the source's model (``weights.Source``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from kiln.checkpointing.huggingface import config as hf_config
from kiln.recipes.config.files import to_dict
from kiln.recipes.loading.hf_recipe import TRAINING_ONLY, differences
from kiln.recipes.loading.weights import Source


@dataclass
class Started:
    """What loading ``init_from`` into a run found: the base record of an adapters-only run,
    and the run its weights came from (a kiln export), for the run's lineage."""

    base_record: dict[str, str] | None = None
    parent: dict[str, Any] | None = None
    lines: list[str] = field(default_factory=list)


def load_pretrained(model: nn.Module, recipe, *, is_main: bool,
                    adapters_only: bool, resumed: bool = False) -> Started:
    """Load ``checkpoint.init_from`` into a run's (built, parallelized) model; every rank calls
    it. ``adapters_only``: the run saves its adapters alone, so it records its base;
    ``resumed``: the adapters came from a checkpoint, this is their frozen base read again."""
    source = Source.open(recipe, is_main=is_main)
    if source.kind == "hf":
        table = hf_config.model_table(source.config, source.spec,
                                      tuple(recipe.checkpoint.init_from_ignore))
        recipe_table = to_dict(recipe)["model"]
        if not recipe_table.get("vocab_size"):  # 0: the tokenizer's size, as built
            recipe_table["vocab_size"] = getattr(model, "vocab_size", 0)
        notes = differences(table, recipe_table, skip=TRAINING_ONLY)
    else:
        notes = source.model_differences(recipe)
    started = Started(lines=[f"kiln: note: init_from differs: {line}" for line in notes])
    n = source.load(model)
    started.lines.append(
        f"kiln: the adapters' frozen base from {source.spec} ({n} tensors)" if resumed
        else f"kiln: initial weights from {source.spec} ({n} tensors)")
    if adapters_only:
        started.base_record = source.base_record()
    started.parent = source.parent()
    return started

"""``checkpoint.init_from``: the weights a fresh run starts from, and the frozen base an
adapters-only checkpoint was trained on.

``init_from`` names a Hugging Face model folder or ``hf://OWNER/NAME[@REVISION]`` (a kiln run
becomes one with ``kiln export``). What it holds is known by content, not by place: an adapter
run records its base's weights fingerprint (``importer.content_fingerprint``) in every
checkpoint, and resuming, exporting, evaluating or generating from that checkpoint on a base
whose weights changed is refused (``checkpointing/resume.check_base``), while a base moved to
another folder with the same weights is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from kiln.checkpointing.huggingface import config as hf_config
from kiln.checkpointing.huggingface import importer as hf_import
from kiln.checkpointing.resume import check_base
from kiln.recipes.config.files import to_dict
from kiln.recipes.loading.hf_recipe import differences
from kiln.recipes.runs import lineage


def place(spec: str) -> str:
    """An ``init_from`` as a comparable place: a Hub path as written, a folder resolved."""
    return spec if spec.startswith("hf://") else str(Path(spec).expanduser().resolve())


@dataclass
class Source:
    """An ``init_from`` made local: its spec, folder and config.json."""

    spec: str
    folder: Path
    config: dict[str, Any]

    @classmethod
    def open(cls, recipe, *, is_main: bool = True, spec: str = "") -> Source:
        """The recipe's ``init_from``, or another ``spec`` of the same kind (a teacher)."""
        cfg = recipe.checkpoint
        spec = spec or cfg.init_from
        folder = hf_import.source_folder(spec, is_main=is_main, token_env=cfg.hub_token_env)
        return cls(spec, Path(folder), hf_import.read_config(Path(folder)))

    def base_record(self) -> dict[str, str]:
        """What an adapters-only checkpoint keeps of its base (``state.json`` ``base``)."""
        return {"init_from": self.spec, "fingerprint": hf_import.content_fingerprint(self.folder)}

    def load(self, model: nn.Module) -> int:
        """Copy the weights into ``model`` (built, possibly sharded); the tensors read."""
        return hf_import.load_weights(model, self.folder, self.config, label=self.spec)


@dataclass
class Started:
    """What loading ``init_from`` into a run found: the base record of an adapters-only run,
    and the run its weights came from (a kiln export), for the run's lineage."""

    base_record: dict[str, str] | None = None
    parent: dict[str, Any] | None = None
    lines: list[str] = field(default_factory=list)


def load_pretrained(model: nn.Module, recipe, *, is_main: bool,
                    adapters_only: bool) -> Started:
    """Load ``checkpoint.init_from`` into a run's (built, parallelized) model; every rank calls
    it. ``adapters_only``: the run saves its adapters alone, so it records its base."""
    source = Source.open(recipe, is_main=is_main)
    table = hf_config.model_table(source.config, source.spec,
                                  tuple(recipe.checkpoint.init_from_ignore))
    hf_config.check_context(source.config, source.spec, recipe.training.seq_len)
    recipe_table = to_dict(recipe)["model"]
    if not recipe_table.get("vocab_size"):  # 0: the tokenizer's size, as built
        recipe_table["vocab_size"] = getattr(model, "vocab_size", 0)
    started = Started(lines=[f"kiln: note: init_from differs: {line}"
                             for line in differences(table, recipe_table)])
    n = source.load(model)
    started.lines.append(f"kiln: initial weights from {source.spec} ({n} tensors)")
    if adapters_only:
        started.base_record = source.base_record()
    exported = lineage.export_source(source.folder)  # a kiln export: the run it came from
    if exported is not None:
        started.parent = {**exported, "how": "init_from"}
    return started


def load_adapter_base(model: nn.Module, recipe, checkpoint: Path) -> None:
    """The frozen base of an adapters-only ``checkpoint``: its recipe's ``init_from``, refused
    when its weights are not those the adapters were trained on."""
    source = Source.open(recipe)
    check_base(checkpoint, source.base_record(), lambda spec: spec)  # (the recipe's own place)
    source.load(model)

"""Where weights come from: a kiln checkpoint (rebuilt from the recipe it holds; an
adapters-only one on its base) and ``Source``, what ``checkpoint.init_from`` names: a Hugging
Face model folder, ``hf://OWNER/NAME[@REVISION]``, or a kiln checkpoint or run folder.

What a source holds is known by content, not by place: an adapter run records its base's
fingerprint (a Hugging Face folder's weights, a kiln checkpoint's manifest, which lists every
file's checksum) in every checkpoint, and resuming, exporting, evaluating or generating from
that checkpoint on a base whose weights changed is refused (``checkpointing/resume.check_base``),
while a base moved to another folder with the same weights is accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from kiln.checkpointing import layout, storage
from kiln.checkpointing.huggingface import importer as hf_import
from kiln.checkpointing.huggingface import layout as hf_layout
from kiln.checkpointing.resume import check_base, find_checkpoint, parent_record
from kiln.components.adapter_contract import adapter_layers
from kiln.components.errors import CheckpointError
from kiln.components.models.block import padded_vocab
from kiln.parallelisms.meta_init import materialize
from kiln.recipes.config.files import load_recipe, to_dict
from kiln.recipes.loading.hf_recipe import differences
from kiln.recipes.runs import lineage


def place(spec: str) -> str:
    """An ``init_from`` as a comparable place: a Hub path as written, a folder resolved."""
    return spec if spec.startswith("hf://") else str(Path(spec).expanduser().resolve())


def is_kiln_checkpoint(spec: str) -> bool:
    """Whether an ``init_from`` names a kiln checkpoint or run folder (else a Hugging Face
    folder or Hub path)."""
    local = Path(spec).expanduser()
    return not spec.startswith("hf://") and not (local / "config.json").is_file() and (
        (local / layout.MANIFEST).is_file() or (local / "checkpoints").is_dir())


@dataclass
class Source:
    """An ``init_from`` made local: its spec, its kind (``hf`` or ``kiln``), its folder (a
    kiln run folder resolves to its newest complete checkpoint) and, for ``hf``, config.json."""

    spec: str
    kind: str
    folder: Path
    config: dict[str, Any]

    @classmethod
    def open(cls, recipe, *, is_main: bool = True, spec: str = "") -> Source:
        """The recipe's ``init_from``, or another ``spec`` of the same kinds (a teacher)."""
        cfg = recipe.checkpoint
        spec = spec or cfg.init_from
        local = Path(spec).expanduser()
        if not spec.startswith("hf://") and not local.is_dir():
            raise CheckpointError(
                f"checkpoint.init_from = {spec!r}: no such folder; name a Hugging Face model "
                "folder, hf://OWNER/NAME[@REVISION], or a kiln checkpoint or run folder")
        if is_kiln_checkpoint(spec):
            return cls(spec, "kiln", find_checkpoint(local, "checkpoint.init_from"), {})
        folder = hf_import.source_folder(spec, is_main=is_main, token_env=cfg.hub_token_env)
        return cls(spec, "hf", Path(folder), hf_import.read_config(Path(folder)))

    def fingerprint(self) -> str:
        """What the weights are, wherever they live."""
        if self.kind == "hf":
            return hf_import.content_fingerprint(self.folder)
        manifest = (self.folder / layout.MANIFEST).read_bytes()  # every file's checksum
        return xxhash.xxh3_128_hexdigest(manifest)

    def base_record(self) -> dict[str, str]:
        """What an adapters-only checkpoint keeps of its base (``state.json`` ``base``)."""
        return {"init_from": self.spec, "fingerprint": self.fingerprint()}

    def parent(self) -> dict[str, Any] | None:
        """The kiln run these weights come from (``RUN/parent.json``), if known."""
        if self.kind == "kiln":
            return parent_record(self.folder, "init_from")
        exported = lineage.export_source(self.folder)  # a kiln export names its checkpoint
        return None if exported is None else {**exported, "how": "init_from"}

    def model_differences(self, recipe) -> list[str]:
        """A kiln checkpoint's ``[model]`` keys that differ from ``recipe``'s."""
        if self.kind != "kiln":
            return []
        theirs, ours = to_dict(load_recipe(self.folder))["model"], to_dict(recipe)["model"]
        return differences(theirs, ours, source=f"in {self.spec}")

    def check(self, model: nn.Module) -> None:
        """What ``load`` checks before it reads a tensor, on ``model`` built on the meta device:
        a Hugging Face folder's files readable, every tensor there with its shape. (A kiln
        checkpoint's tensors are checked as they load: its manifest has no shapes.)"""
        if self.kind == "hf":
            hf_import.load_weights(model, self.folder, self.config, label=self.spec,
                                   check_only=True)

    def load(self, model: nn.Module) -> int:
        """Copy the weights into ``model`` (built, possibly sharded: each rank fills its own
        shard); the tensors read."""
        if self.kind == "hf":
            return hf_import.load_weights(model, self.folder, self.config, label=self.spec)
        recipe, _, whole = load_model(self.folder)  # on the CPU, whole: every rank reads it
        if recipe.adapter is not None:
            recipe.adapter.build().merge(whole)  # an adapters-only fine-tune: merged
        return copy_whole(whole, model, label=self.spec)


@torch.no_grad()
def copy_whole(source: nn.Module, model: nn.Module, *, label: str) -> int:
    """Copy every weight of ``source`` (whole, on the CPU) into ``model`` by name: each rank
    its own region of a sharded parameter. Every tensor of ``model`` must be there with its
    shape, and every tensor of ``source`` used."""
    have = hf_layout.tensors(source)
    want = hf_layout.tensors(model)
    missing = sorted(set(want) - set(have))
    extra = sorted(set(have) - set(want))
    for problem, names in (("lacks", missing), ("has no place in the recipe's model for", extra)):
        if names:
            raise CheckpointError(f"checkpoint.init_from = {label!r}: the checkpoint {problem} "
                                  f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''}; "
                                  "the recipe's [model] must be the checkpoint's")
    for name, t in want.items():
        if tuple(have[name].shape) != tuple(t.shape):
            raise CheckpointError(f"checkpoint.init_from = {label!r}: {name} has shape "
                                  f"{list(have[name].shape)}, the recipe's model needs "
                                  f"{list(t.shape)}")
        local, offset, shape = hf_import.local_region(t)
        if local.numel():
            part = have[name][tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
            local.copy_(part.to(local.dtype))
    return len(want)


def load_adapter_base(model: nn.Module, recipe, checkpoint: Path) -> None:
    """The frozen base of an adapters-only ``checkpoint``: its recipe's ``init_from``, refused
    when its weights are not those the adapters were trained on."""
    source = Source.open(recipe)
    check_base(checkpoint, source.base_record(), lambda spec: spec)  # (the recipe's own place)
    source.load(model)


def load_model(checkpoint: Path, *, min_seq_len: int = 0, base: bool = True):
    """(recipe, tokenizer, model with the checkpoint's weights on the CPU). ``min_seq_len``
    lengthens the position tables of a model whose length follows training.seq_len (model
    max_seq_len = 0), e.g. to generate past the trained context. An adapters-only checkpoint's
    frozen base is read from its ``init_from``; ``base = False`` leaves those weights
    unallocated, for what reads the adapters alone (``--format peft``)."""
    layout.verify(checkpoint, hashes=True)
    recipe = load_recipe(checkpoint)
    tokenizer = recipe.tokenizer.build()
    seq_len = max(recipe.training.seq_len, min_seq_len)
    adapter = recipe.adapter.build() if recipe.adapter is not None else None
    with torch.device("meta"):
        model = recipe.model.build(vocab_size=padded_vocab(recipe.model, tokenizer.vocab_size),
                                   seq_len=seq_len)
        if adapter is not None:  # its tensors are in the checkpoint too
            adapter.apply(model)
    adapters_only = adapter is not None and bool(recipe.checkpoint.init_from)
    if adapters_only and not base:  # the adapters alone: the base stays on the meta device
        for _, _, layer in adapter_layers(model).values():
            layer.to_empty(device="cpu")
    elif adapters_only:  # initialised as the run was: what the base lacks keeps its init (the
        # routing bias of a family without one, multi-token prediction modules)
        with torch.random.fork_rng(devices=[]):
            materialize(model, "cpu", recipe.training.seed)
    else:
        model = model.to_empty(device="cpu")
    if adapters_only:  # the base: from init_from
        sd = {k: v for k, v in model.state_dict().items() if adapter.owns(k)}
        if base:
            load_adapter_base(model, recipe, checkpoint)
    else:
        sd = get_model_state_dict(model)
    tensors, _ = storage.split_tree({"model": sd})
    storage.load_tensors(tensors, checkpoint, no_dist=True,
                         hint=" -- cannot load the model's weights from the recipe it holds")
    model.load_state_dict(tensors["model"], strict=False)
    for module in model.modules():  # non-persistent buffers (RoPE tables) are derived
        reset = getattr(module, "reset_buffers", None)
        if reset is not None:
            reset()
    return recipe, tokenizer, model

"""A saved model rebuilt for use: a kiln checkpoint from the recipe it holds (an adapters-only
one on its base), or a Hugging Face folder through the recipe ``kiln import`` writes for it. For
``kiln eval``, ``kiln export`` and ``kiln generate``."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from kiln.checkpointing import layout, storage
from kiln.checkpointing.huggingface import files as hf_files
from kiln.components.models.block import padded_vocab
from kiln.components.protocols import adapter_layers
from kiln.recipes.config.files import load_recipe
from kiln.recipes.loading.init_from import load_adapter_base


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


def load_hf_folder(folder: Path, overrides: list[str] | tuple[str, ...] = ()):
    """(recipe, tokenizer, model) of a Hugging Face model folder: the recipe ``kiln import``
    writes for it (in a temporary file), the weights loaded through ``checkpointing.hf_import``."""
    import tempfile

    from kiln.checkpointing.huggingface import importer as hf_import
    from kiln.recipes.loading.hf_recipe import import_recipe

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{Path(folder).name or 'model'}.toml"
        import_recipe(str(folder), path)
        recipe = load_recipe(path, overrides)
    tokenizer = recipe.tokenizer.build()
    model = recipe.model.build(vocab_size=padded_vocab(recipe.model, tokenizer.vocab_size),
                               seq_len=recipe.training.seq_len)
    hf_import.load_weights(model, Path(folder), hf_import.read_config(Path(folder)))
    return recipe, tokenizer, model


def is_hf_folder(path: Path) -> bool:
    """config.json + safetensors weights is a model to evaluate, whatever else the folder holds
    (kiln's own export carries recipe.toml too); a run or checkpoint folder has no config.json.
    config.json alone, without a recipe.toml, counts too (the weights' error comes later)."""
    if not (path / "config.json").is_file():
        return False
    return bool(hf_files.weight_files(path)) or not (path / "recipe.toml").is_file()


def open_model(path: str | Path, *, step: int = 0, overrides: list[str] | tuple[str, ...] = ()):
    """(recipe, tokenizer, model on the CPU, label) of a run folder (its newest checkpoint, or
    ``step``), a checkpoint folder or a Hugging Face model folder (config.json + safetensors).
    ``overrides`` apply to the recipe (e.g. ``--evals.NAME.limit=10``)."""
    from kiln.checkpointing.resume import find_checkpoint
    from kiln.components.errors import CheckpointError

    path = Path(path).expanduser()
    if is_hf_folder(path):
        if step:
            raise CheckpointError(f"{path} is a Hugging Face model folder: it has no steps "
                                  "(drop --step)")
        recipe, tokenizer, model = load_hf_folder(path, overrides)
        return recipe, tokenizer, model, str(path)
    ckpt = find_checkpoint(path)
    if step:
        ckpt = ckpt.parent / layout.step_name(step)
        if not layout.is_complete(ckpt):
            steps = [s for s, p in layout.list_checkpoints(ckpt.parent) if layout.is_complete(p)]
            raise CheckpointError(f"{ckpt}: no complete checkpoint of step {step}; steps there: "
                                  f"{', '.join(map(str, steps)) or 'none'}")
    recipe, tokenizer, model = load_model(ckpt)
    if overrides:
        recipe = load_recipe(ckpt, overrides)
    return recipe, tokenizer, model, str(ckpt)

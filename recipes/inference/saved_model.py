"""A checkpoint's model, rebuilt from the recipe it holds: for ``kiln eval``, ``kiln export`` and
``kiln generate`` (the checkpointing package reads and writes tensors; building models from
recipes happens here, on the top floor). Also the trainer's export of its live model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from kiln.checkpointing import layout, storage
from kiln.checkpointing.huggingface import export as export_lib
from kiln.checkpointing.huggingface import files as hf_files
from kiln.components.errors import RecipeError
from kiln.components.models.block import padded_vocab
from kiln.recipes.config.files import load_recipe, to_dict
from kiln.recipes.runs import lineage


def load_model(checkpoint: Path, *, min_seq_len: int = 0):
    """(recipe, tokenizer, model with the checkpoint's weights on the CPU). ``min_seq_len``
    lengthens the position tables of a model whose length follows training.seq_len (model
    max_seq_len = 0), e.g. to generate past the trained context."""
    layout.verify(checkpoint, hashes=True)
    recipe = load_recipe(checkpoint)
    tokenizer = recipe.tokenizer.build()
    seq_len = max(recipe.training.seq_len, min_seq_len)
    with torch.device("meta"):
        model = recipe.model.build(vocab_size=padded_vocab(recipe.model, tokenizer.vocab_size),
                                   seq_len=seq_len)
        if recipe.adapter is not None:  # its tensors are in the checkpoint too
            recipe.adapter.build().apply(model)
    model = model.to_empty(device="cpu")
    sd = get_model_state_dict(model)
    if recipe.adapter is not None and recipe.checkpoint.init_from:
        from kiln.components.adapters.lora import is_adapter

        sd = {k: v for k, v in sd.items() if is_adapter(k)}  # the base: from init_from
        _load_base(model, recipe, checkpoint)
    tensors, _ = storage.split_tree({"model": sd})
    storage.load_tensors(tensors, checkpoint, no_dist=True,
                         hint=" -- cannot load the model's weights from the recipe it holds")
    model.load_state_dict(tensors["model"], strict=False)
    for module in model.modules():  # non-persistent buffers (RoPE tables) are derived
        reset = getattr(module, "reset_buffers", None)
        if reset is not None:
            reset()
    return recipe, tokenizer, model


def _load_base(model, recipe, checkpoint: Path) -> None:
    """The frozen base weights of a LoRA run: its ``checkpoint.init_from``, refused when its
    weights are not those the adapters of ``checkpoint`` were trained on."""
    from kiln.checkpointing.huggingface import importer as hf_import
    from kiln.checkpointing.resume import check_base

    cfg = recipe.checkpoint
    folder = hf_import.source_folder(cfg.init_from, is_main=True, token_env=cfg.hub_token_env)
    record = {"init_from": cfg.init_from,
              "fingerprint": hf_import.content_fingerprint(Path(folder))}
    check_base(checkpoint, record, lambda spec: spec)  # (the place is the recipe's own)
    hf_import.load_weights(model, folder, hf_import.read_config(folder), label=cfg.init_from)


def tokenizer_files(tokenizer):
    """A writer of the tokenizer's own files into an export folder, or None (a tokenizer
    without ``save_files``: nothing to write)."""
    save = getattr(tokenizer, "save_files", None)
    return save if callable(save) else None


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, fmt: str = "auto", *,
                      force: bool = False, max_shard_size: str | int = "5GB",
                      dtype: str = "") -> dict[str, Any]:
    """``kiln export``: load the checkpoint's model and write it (``checkpointing.export``;
    a non-empty ``out_dir`` needs ``force``). A LoRA run's adapters are merged into the
    weights, or written alone with ``fmt = "peft"``; a chat run's template goes along as
    ``chat_template.jinja`` (which transformers reads)."""
    checkpoint = Path(checkpoint)
    recipe, tokenizer, model = load_model(checkpoint)
    if recipe.adapter is not None:
        from kiln.checkpointing.huggingface.peft_export import export_peft
        from kiln.components.adapters.lora import merge

        if fmt == "peft":
            if not recipe.checkpoint.init_from:
                raise RecipeError(
                    f"{checkpoint}: its adapters were trained on the model's random "
                    "initialisation (adapter.allow_random_base, no checkpoint.init_from), so a "
                    "peft adapter would name no base to load it on; export the merged weights "
                    "instead (--format hf)")
            summary = export_peft(model, out_dir, base=recipe.checkpoint.init_from,
                                  dropout=getattr(recipe.adapter, "dropout", 0.0), force=force)
            return _with_template(summary, checkpoint, recipe, tokenizer, Path(out_dir))
        merge(model)  # the merged weights: the same function without adapters
    elif fmt == "peft":
        raise RecipeError(f"{checkpoint}: --format peft needs a run with an [adapter] table; "
                          "this one fine-tuned every weight: use --format hf")
    summary = export_lib.export(model, tokenizer, out_dir, model_table=to_dict(recipe)["model"],
                                recipe_file=checkpoint / "recipe.toml", fmt=fmt, force=force,
                                max_shard_size=max_shard_size, dtype=dtype,
                                tokenizer_files=tokenizer_files(tokenizer))
    lineage.write_export_source(Path(out_dir), checkpoint)  # a fine-tune of it knows its parent
    return _with_template(summary, checkpoint, recipe, tokenizer, Path(out_dir))


def _with_template(summary: dict[str, Any], checkpoint: Path, recipe, tokenizer,
                   out_dir: Path) -> dict[str, Any]:
    """Put the chat template a run trained with beside its export."""
    from kiln.components.tokenizers.chat_templates import TEMPLATE_FILE

    saved = checkpoint.parent.parent / TEMPLATE_FILE  # RUN/checkpoints/step_N -> RUN
    if saved.is_file():
        source = saved.read_text(encoding="utf-8")
    elif recipe.data.type == "chat":
        from kiln.components.tokenizers.chat_templates import resolve

        source = resolve(recipe.data.template, tokenizer).source
    else:
        return summary
    from kiln.recipes.config.files import write_text_atomic

    write_text_atomic(out_dir / TEMPLATE_FILE, source)
    return {**summary, "files": sorted({*summary["files"], TEMPLATE_FILE})}


def export_trainer_model(trainer, out_dir: Path) -> dict[str, Any]:
    """The trainer's live (possibly sharded) model as an export; every rank calls this. The
    run's own export folder: a rerun rewrites the export's files there (``force``)."""
    recipe = trainer.recipe
    return export_lib.export(
        trainer.model, trainer.tokenizer, out_dir, model_table=to_dict(recipe)["model"],
        recipe_file=Path(trainer.run_dir) / "recipe.toml", force=True,
        max_shard_size=recipe.checkpoint.export_max_shard_size,
        tokenizer_files=tokenizer_files(trainer.tokenizer),
        rank=trainer.world.rank, world_size=trainer.world.world_size)


def load_hf_folder(folder: Path, overrides: list[str] | tuple[str, ...] = ()):
    """(recipe, tokenizer, model) of a Hugging Face model folder: the recipe ``kiln import``
    writes for it (in a temporary file), the weights loaded through ``checkpointing.hf_import``."""
    import tempfile

    from kiln.checkpointing.huggingface import importer as hf_import
    from kiln.recipes.inference.pretrained import import_recipe

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

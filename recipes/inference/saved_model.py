"""Exports of a trained model: ``kiln export`` of a checkpoint (merged, or its adapters alone in
``peft``'s form) and the trainer's export of its live model (the checkpointing package writes
the tensors; reading the model is ``recipes/loading``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.checkpointing.huggingface import export as export_lib
from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe, to_dict
from kiln.recipes.loading.checkpoint_model import load_model
from kiln.recipes.loading.weights import is_kiln_checkpoint
from kiln.recipes.runs import lineage


def tokenizer_files(tokenizer):
    """A writer of the tokenizer's own files into an export folder, or None (a tokenizer
    without ``save_files``: nothing to write)."""
    save = getattr(tokenizer, "save_files", None)
    return save if callable(save) else None


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, fmt: str = "auto", *,
                      force: bool = False, max_shard_size: str | int = "5GB",
                      dtype: str = "") -> dict[str, Any]:
    """``kiln export``: load the checkpoint's model and write it (``checkpointing.export``;
    a non-empty ``out_dir`` needs ``force``). An adapter run's adapters are merged into the
    weights, or written alone with ``fmt = "peft"``; a chat run's template goes along as
    ``chat_template.jinja`` (which transformers reads)."""
    checkpoint = Path(checkpoint)
    if fmt == "peft":
        return _export_adapters(checkpoint, Path(out_dir), force=force)
    recipe, tokenizer, model = load_model(checkpoint)
    if recipe.adapter is not None:
        recipe.adapter.build().merge(model)  # the merged weights: the same function
    summary = export_lib.export(model, tokenizer, out_dir, model_table=to_dict(recipe)["model"],
                                recipe_file=checkpoint / "recipe.toml", fmt=fmt, force=force,
                                max_shard_size=max_shard_size, dtype=dtype,
                                tokenizer_files=tokenizer_files(tokenizer))
    lineage.write_export_source(Path(out_dir), checkpoint)  # a fine-tune of it knows its parent
    return _with_template(summary, checkpoint, recipe, tokenizer, Path(out_dir))


def _export_adapters(checkpoint: Path, out_dir: Path, *, force: bool) -> dict[str, Any]:
    """``--format peft``: the adapters alone, in ``peft``'s form. The base's weights are not
    read (nor need they be there): the folder names it, and ``peft`` loads it."""
    from kiln.checkpointing.huggingface.peft_export import export_peft

    recipe = load_recipe(checkpoint)
    if recipe.adapter is None:
        raise RecipeError(f"{checkpoint}: --format peft needs a run with an [adapter] table; "
                          "this one fine-tuned every weight: use --format hf")
    if not recipe.checkpoint.init_from:
        raise RecipeError(
            f"{checkpoint}: its adapters were trained on the model's random initialisation "
            "(adapter.allow_random_base, no checkpoint.init_from), so a peft adapter would "
            "name no base to load it on; export the merged weights instead (--format hf)")
    recipe, tokenizer, model = load_model(checkpoint, base=False)
    base = recipe.checkpoint.init_from
    summary = export_peft(model, out_dir, base=base,
                          fields=recipe.adapter.build().peft_config(), force=force)
    if is_kiln_checkpoint(base):  # peft's base_model_name_or_path is for transformers
        summary["base_note"] = (
            f"the base, {base}, is a kiln checkpoint, which transformers cannot load: export it "
            f"(kiln export {base} BASE_DIR) and load the adapter onto that folder, or export "
            "this checkpoint merged (--format hf)")
    return _with_template(summary, checkpoint, recipe, tokenizer, out_dir)


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



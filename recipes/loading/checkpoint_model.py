"""A saved model opened for use by ``kiln eval``, ``kiln export`` and ``kiln generate``: a run
folder (its newest checkpoint, or a step), a checkpoint folder (``weights.load_model``), or a
Hugging Face folder through the recipe ``kiln import`` writes for it."""

from __future__ import annotations

from pathlib import Path

from kiln.checkpointing import layout
from kiln.checkpointing.huggingface import files as hf_files
from kiln.components.models.block import padded_vocab
from kiln.recipes.config.files import load_recipe
from kiln.recipes.loading.weights import load_model


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

"""model.vocab_size = 0 pads the tokenizer's vocabulary to vocab_multiple; padded rows are never
targets; a model vocabulary smaller than the tokenizer's is a recipe error."""

from __future__ import annotations

import os

import pytest

from kiln.components.errors import RecipeError
from kiln.components.models.block import padded_vocab
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.conftest import CONFIGS
from tests.recipes.training.test_trainer import TINY


def _trainer(tmp_path, *extra):
    recipe = load_recipe(CONFIGS / "debug.toml", [*TINY, f"--run.folder={tmp_path / 'r'}",
                                                 *extra])
    return Trainer(recipe, out=open(os.devnull, "w"), checkpoints=False)


def test_padded_vocab_rounds_up_unless_set(tmp_path):
    cfg = load_recipe(CONFIGS / "debug.toml").model
    assert padded_vocab(cfg, 258) == 320 and padded_vocab(cfg, 320) == 320
    cfg.vocab_multiple = 1
    assert padded_vocab(cfg, 258) == 258
    cfg.vocab_size = 300
    assert padded_vocab(cfg, 258) == 300


def test_trainer_builds_the_padded_model_and_targets_stay_below_the_tokenizer(tmp_path):
    t = _trainer(tmp_path)
    assert t.tokenizer.vocab_size == 258 and t.model.vocab_size == 320
    assert t.model.output.weight.shape[0] == 320 or t.model.tok_embeddings.weight.shape[0] == 320
    for _ in range(4):
        batch = next(iter(t.train_loader))
        assert int(batch["labels"].max()) < t.tokenizer.vocab_size


def test_model_vocab_smaller_than_the_tokenizer_is_an_error(tmp_path):
    with pytest.raises(RecipeError, match="smaller than the tokenizer's vocabulary"):
        _trainer(tmp_path, "--model.vocab_size=100")

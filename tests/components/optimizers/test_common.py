"""What the optimizer configs share: the Adam family's betas and every optimizer's weight decay
are checked with the recipe."""

from __future__ import annotations

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe
from tests.conftest import REPO


@pytest.mark.parametrize(("recipe", "key"), [
    ("debug.toml", "optimizer"),  # adamw
    ("looped_moe_debug.toml", "optimizers.main"),  # adam_atan2
])
@pytest.mark.parametrize("betas", ["[0.9, 1.0]", "[-0.1, 0.95]"])
def test_adam_betas_outside_0_1_are_refused_naming_the_key(recipe, key, betas):
    # torch.optim.AdamW raised a bare ValueError when the optimizer was built
    with pytest.raises(RecipeError) as err:
        load_recipe(REPO / "train_configs" / recipe, [f"--{key}.betas={betas}"])
    assert str(err.value).startswith(f"command line: {key}.betas = ")
    assert "each beta must lie in [0, 1)" in str(err.value)


def test_adamw8bit_betas_are_checked_too():
    with pytest.raises(RecipeError, match="each beta must lie in"):
        load_recipe(REPO / "train_configs/debug.toml",
                    ["--optimizer.type=adamw8bit", "--optimizer.betas=[1, 0.95]"])


@pytest.mark.parametrize("optimizer", ["adamw", "muon", "sgd", "adam_atan2"])
def test_a_weight_decay_that_would_flip_the_weights_is_refused(optimizer):
    """weight_decay = 1e30 passed validate and trained to NaN at step 2, with a message that
    blamed the learning rate."""
    path = REPO / "train_configs/debug.toml"
    with pytest.raises(RecipeError, match=r"\[optimizer\]: lr \* weight_decay = 0.5 \* 2 >= 1"):
        load_recipe(path, [f"--optimizer.type={optimizer}", "--optimizer.lr=0.5",
                           "--optimizer.weight_decay=2"])
    load_recipe(path, [f"--optimizer.type={optimizer}", "--optimizer.lr=0.5",
                       "--optimizer.weight_decay=1.99"])

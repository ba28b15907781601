"""Recipe files, extends chains and overrides: merging and precedence."""

from __future__ import annotations

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.loader import load_layers, parse_override
from kiln.recipes.recipe import load_recipe, to_toml


def test_override_values_are_toml_literals():
    assert parse_override("--training.steps=7") == ("training.steps", 7)
    assert parse_override("--optimizer.lr=3e-4") == ("optimizer.lr", 3e-4)
    assert parse_override("--run.tensorboard=false") == ("run.tensorboard", False)
    assert parse_override("--optimizer.betas=[0.9, 0.99]") == ("optimizer.betas", [0.9, 0.99])
    assert parse_override('--run.name="x y"') == ("run.name", "x y")
    # A bare word is taken as a string so component switches read naturally.
    assert parse_override("--model.attention.type=differential") == (
        "model.attention.type", "differential")


@pytest.mark.parametrize("arg", ["training.steps=7", "--training.steps", "--=3", "--a..b=1",
                                 "--a.b=[1,", "--a.b="])
def test_bad_override_syntax(arg):
    with pytest.raises(RecipeError, match="bad override"):
        parse_override(arg)


def test_extends_chain_deep_merges_and_child_wins(write):
    write("base.toml", """
        [training]
        steps = 10
        seq_len = 64
        [model]
        type = "transformer"
        dim = 64
    """)
    write("mid.toml", """
        extends = "base.toml"
        [training]
        steps = 20
    """)
    top = write("sub/top.toml", """
        extends = "../mid.toml"
        [model]
        n_layers = 2
    """)
    layers = load_layers(top)
    assert layers.data["training"] == {"steps": 20, "seq_len": 64}
    assert layers.data["model"] == {"type": "transformer", "dim": 64, "n_layers": 2}
    assert layers.source("training.steps").endswith("mid.toml")
    assert layers.source("model.n_layers").endswith("top.toml")


def test_precedence_cli_over_file_over_extends_over_defaults(write):
    write("base.toml", "[training]\nsteps = 10\nseed = 3\n")
    top = write("top.toml", 'extends = "base.toml"\n[training]\nsteps = 20\n')
    recipe = load_recipe(top, ["--training.steps=30"])
    assert recipe.training.steps == 30  # CLI
    assert recipe.training.seed == 3  # extends
    assert recipe.training.seq_len == 256  # component default
    assert load_recipe(top).training.steps == 20  # file over extends


def test_resolved_recipe_round_trips(write, tmp_path):
    top = write("r.toml", '[model]\ntype = "transformer"\ndim = 64\n[training]\nsteps = 5\n')
    recipe = load_recipe(top, ["--optimizer.lr=1e-3"])
    text = to_toml(recipe)
    again = write("resolved.toml", text)
    assert load_recipe(again) == recipe
    assert "[model.attention]" in text and 'type = "causal"' in text  # every component named


def test_run_name_and_folder_default_from_file_name(write):
    recipe = load_recipe(write("my_run.toml", "[training]\nsteps = 1\n"))
    assert recipe.run.name == "my_run"
    assert recipe.run.folder.endswith("runs/my_run")


def test_switching_type_in_a_higher_layer_drops_foreign_keys(write):
    base = write("b.toml", """
        [model]
        type = "transformer"
        [model.ffn]
        type = "swiglu"
        hidden_dim = 96
        multiple_of = 32
    """)
    # The override switches the schedule type; keys of the old type that the new one lacks
    # are dropped, shared keys are kept.
    write("c.toml", """
        extends = "b.toml"
        [optimizer]
        type = "adamw"
        [optimizer.schedule]
        type = "warmup_cosine"
        min_lr_ratio = 0.2
        warmup_steps = 3
    """)
    recipe = load_recipe(base.parent / "c.toml", ["--optimizer.schedule.type=wsd"])
    assert recipe.optimizer.schedule.type == "wsd"
    assert recipe.optimizer.schedule.warmup_steps == 3
    assert recipe.optimizer.schedule.min_lr_ratio == 0.2

"""Recipe files, extends chains and overrides: merging and precedence."""

from __future__ import annotations

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe, to_toml
from kiln.recipes.config.loader import load_layers, parse_override


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


def test_a_list_whose_quotes_the_shell_removed_gets_the_quoting_to_use():
    with pytest.raises(RecipeError, match=r"a list's strings need quotes.*"
                       r"--model.layer_types='\[\"a\", \"b\"\]'"):
        parse_override("--model.layer_types=[linear,full]")  # the shell ate the quotes
    assert parse_override('--model.layer_types=["linear","full"]')[1] == ["linear", "full"]


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


DEBUG_MULTI = """
    extends = "{base}"
    [optimizers.muon]
    type = "muon"
    lr = 0.02
    params = {{ ndim = [2], exclude = ["tok_embeddings.*", "output.*"] }}
    [optimizers.adamw]
    type = "adamw"
    params = {{ rest = true }}
"""


def test_a_child_switching_to_named_optimizers_replaces_the_inherited_table(write):
    from tests.conftest import CONFIGS

    child = write("multi.toml", DEBUG_MULTI.format(base=CONFIGS / "debug.toml"))
    recipe = load_recipe(child)
    assert recipe.optimizer is None and sorted(recipe.optimizers) == ["adamw", "muon"]
    # ... and back: a grandchild with [optimizer] replaces the named optimizers.
    back = write("back.toml", 'extends = "multi.toml"\n[optimizer]\nlr = 1e-3\n')
    recipe = load_recipe(back)
    assert recipe.optimizers == {} and recipe.optimizer.type == "adamw"
    assert recipe.optimizer.lr == 1e-3 and recipe.optimizer.weight_decay == 0.0  # not debug's


def test_both_optimizer_tables_in_one_file_or_on_the_command_line_is_an_error(write):
    both = write("both.toml", '[optimizer]\nlr = 1e-3\n[optimizers.a]\ntype = "adamw"\n')
    with pytest.raises(RecipeError) as info:
        load_recipe(both)
    msg = str(info.value)
    assert msg.startswith("[optimizer] (") and "[optimizers.a] (" in msg and "{" not in msg
    one = write("one.toml", "[optimizer]\nlr = 1e-3\n")
    with pytest.raises(RecipeError, match=r"\[optimizers.x\] \(command line\)"):
        load_recipe(one, ["--optimizers.x.lr=1"])


def test_remove_drops_inherited_tables_and_keys(write):
    write("base.toml", """
        [guards.spike]
        type = "spike_guard"
        [eval]
        interval = 7
        tokens = 99
    """)
    child = write("child.toml", 'extends = "base.toml"\nremove = ["guards.spike", "eval.tokens"]\n')
    recipe = load_recipe(child)
    assert recipe.guards == {} and recipe.eval.interval == 7 and recipe.eval.tokens == 65536
    layers = load_layers(child)
    assert "guards.spike" not in layers.sources and "guards.spike.type" not in layers.sources


@pytest.mark.parametrize("text,match", [
    ('remove = ["eval.token"]', "did you mean 'eval.tokens'"),
    ('remove = "eval"', "must be a list of dotted paths"),
])
def test_remove_errors_name_the_file(write, text, match):
    write("base.toml", "[eval]\ntokens = 99\n")
    child = write("child.toml", f'extends = "base.toml"\n{text}\n')
    with pytest.raises(RecipeError, match=match) as info:
        load_recipe(child)
    assert str(info.value).startswith("child.toml") or "child.toml:" in str(info.value)


def test_model_level_errors_name_the_table_and_the_file_that_set_the_key(write):
    write("base.toml", '[model.ffn]\ntype = "moe"\nn_experts = 4\ntop_k = 2\n')
    child = write("child.toml", 'extends = "base.toml"\n[model.ffn]\ntop_k = 8\n')
    with pytest.raises(RecipeError) as info:
        load_recipe(child)
    msg = str(info.value)
    assert msg.endswith("child.toml: [model.ffn]: top_k (8) exceeds n_experts (4)"), msg


def test_an_unknown_section_on_the_command_line_is_blamed_on_the_command_line(write):
    path = write("r.toml", "[training]\nsteps = 3\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path, ["--trainig.steps=5"])
    assert str(info.value).startswith("command line: unknown key trainig (did you mean")

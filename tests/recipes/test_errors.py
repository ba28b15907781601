"""Every malformed recipe gets one clear message naming the file and the key; exit status 2."""

from __future__ import annotations

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.cli import main
from kiln.recipes.config.files import load_recipe


def _error(path, overrides=()) -> str:
    with pytest.raises(RecipeError) as info:
        load_recipe(path, list(overrides))
    return str(info.value)


def test_toml_syntax_error_names_the_line(write):
    path = write("bad.toml", "[training]\nsteps = = 3\n")
    msg = _error(path)
    assert "bad.toml" in msg and "line 2" in msg


def test_unknown_key_lists_valid_keys_and_suggests(write):
    path = write("r.toml", "[training]\nstepss = 3\n")
    msg = _error(path)
    assert "training.stepss" in msg and "did you mean 'steps'" in msg and "global_batch" in msg
    assert "r.toml" in msg


def test_unknown_key_in_a_component_table(write):
    path = write("r.toml", '[model]\ntype = "transformer"\n[model.attention]\nn_head = 4\n')
    msg = _error(path)
    assert "model.attention.n_head" in msg and "n_heads" in msg


def test_wrong_type_names_key_and_expected_type(write):
    path = write("r.toml", '[training]\nsteps = "ten"\n')
    msg = _error(path)
    assert "training.steps" in msg and "'ten'" in msg and "int" in msg


def test_unknown_component_name_lists_choices(write):
    path = write("r.toml", '[model]\ntype = "transformr"\n')
    msg = _error(path)
    assert "model.type" in msg and "did you mean 'transformer'" in msg


def test_component_table_without_type_and_no_default(write):
    path = write("r.toml", "[guards.spikes]\nwarmup_steps = 3\n")
    msg = _error(path)
    assert "[guards.spikes] needs type" in msg


def test_table_without_type_gets_the_default_component(write):
    recipe = load_recipe(write("r.toml", "[model]\ndim = 48\n[model.attention]\nn_heads = 4\n"))
    assert recipe.model.type == "transformer" and recipe.model.attention.type == "causal"


def test_missing_required_key():
    from pydantic import Field

    from kiln.components.base import Config
    from kiln.recipes.config.loader import Layered
    from kiln.recipes.config.resolve import build_config

    class Needs(Config):
        path: str = Field(description="where the data is")

    layers = Layered({}, {"": (0, "x.toml")})
    with pytest.raises(RecipeError) as info:
        build_config(Needs, {}, "data", layers)
    assert "x.toml: missing required key data.path (where the data is)" in str(info.value)


def test_override_errors_name_the_command_line(write):
    path = write("r.toml", "[training]\nsteps = 3\n")
    msg = _error(path, ["--training.steps=many"])
    assert "command line" in msg and "training.steps" in msg
    assert "unknown key training.nope" in _error(path, ["--training.nope=1"])


def test_a_seed_is_a_64_bit_count(write):
    """training.seed = -1 passed validate and failed in the chat loader's NumPy generator
    ("expected non-negative integer"); 2**64 failed torch.manual_seed."""
    path = write("r.toml", "[training]\nsteps = 3\n")
    assert "training.seed = -1: Input should be greater than or equal to 0" in _error(
        path, ["--training.seed=-1"])
    assert "training.seed = 9223372036854775808: Input should be less than" in _error(
        path, ["--training.seed=9223372036854775808"])


def test_extends_cycle_and_missing_extends_file(write):
    write("a.toml", 'extends = "b.toml"\n')
    b = write("b.toml", 'extends = "a.toml"\n')
    assert "cycle" in _error(b)
    c = write("c.toml", 'extends = "nowhere.toml"\n')
    msg = _error(c)
    assert "nowhere.toml" in msg and "does not exist" in msg


def test_missing_recipe_file():
    assert "not found" in _error("no/such/recipe.toml")


def test_value_constraints_are_checked(write):
    path = write("r.toml", "[training]\nmicro_batch = 0\n")
    assert "training.micro_batch" in _error(path)


@pytest.mark.parametrize("text,override", [
    ("[training]\nsteps = = 3\n", None),
    ("[training]\nstepss = 3\n", None),
    ('[training]\nsteps = "x"\n', None),
    ('[model]\ntype = "nope"\n', None),
    ('extends = "missing.toml"\n', None),
    ("[training]\nsteps = 3\n", "training.steps=3"),
])
def test_cli_exits_2_without_traceback(write, capsys, text, override):
    path = write("r.toml", text)
    argv = ["show", str(path)] + ([override] if override else [])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("kiln show: error:")


def test_recipe_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[run]\nname = "x"\ndescription = "caf\xe9"\n')
    msg = _error(path)
    assert "latin1.toml" in msg and "UTF-8" in msg and "line 3" in msg


def test_heads_that_do_not_divide_dim_are_a_recipe_error(write):
    path = write("r.toml", '[model]\ndim = 256\n[model.attention]\nn_heads = 8\n')
    msg = _error(path, ["--model.attention.n_heads=5"])
    assert msg.startswith("command line: [model]:")
    assert "attention.n_heads" in msg and "dim" in msg and "256" in msg
    msg = _error(write("d.toml", '[model]\ndim = 120\n[model.attention]\ntype = "differential"\n'
                                 'n_heads = 4\n'))
    assert "d.toml: [model]:" in msg and "multiple of 4" in msg


def test_heads_that_do_not_divide_dim_fail_validate_and_train_without_traceback(write, capsys):
    path = write("r.toml", "[model]\ndim = 256\n[training]\nsteps = 1\n")
    for command in ("validate", "train"):
        status = main([command, str(path), "--model.attention.n_heads=5"])
        out = capsys.readouterr()
        assert status == 2 and "Traceback" not in out.err
        assert "attention.n_heads" in out.out + out.err


def test_wrong_type_in_a_child_recipe_names_the_child(write):
    write("base.toml", "[training]\nsteps = 3\n")
    child = write("child.toml", 'extends = "base.toml"\n[training.steps]\nx = 1\n')
    msg = _error(child)
    assert "child.toml: training.steps" in msg
    assert "base.toml" not in msg

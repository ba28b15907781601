"""Recipe diffing: keys only in A, only in B, changed values, grouped by table."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from kiln.recipes.cli import main
from kiln.recipes.config.diff import diff, flatten, toml_value
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS


def test_flatten_dotted_keys():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {
        "a.b": 1, "a.c.d": [1, 2]}  # an empty table has no keys


def test_values_print_as_toml_and_empty_tables_are_not_differences(capsys):
    debug, nova = str(CONFIGS / "debug.toml"), str(CONFIGS / "nova_debug.toml")
    assert main(["diff", debug, nova]) == 1
    out = capsys.readouterr().out
    assert '~ type: "causal" -> "differential"' in out and "~ fused_qkv: false -> true" in out
    assert "optimizers = {}" not in out and "False" not in out and "'" not in out
    assert out.index("[model]\n") < out.index("[model.attention]\n")  # tables in order
    for line in out.splitlines():  # every value is a TOML literal that reads back
        if line.startswith(("  + ", "  - ")):
            tomllib.loads(line[4:])
        elif line.startswith("  ~ "):
            key, _, values = line[4:].partition(": ")
            for value in values.split(" -> "):
                tomllib.loads(f"{key} = {value}")


@pytest.mark.parametrize("value, text", [
    (False, "false"), ("causal", '"causal"'), (1e-05, "1e-05"), ([0.9, 0.95], "[0.9, 0.95]"),
    ({}, "{}"), ([{"ndim": [1], "rest": False}], "[{ ndim = [1], rest = false }]"),
    ({"a b": 'q"'}, '{ "a b" = "q\\"" }'), (float("inf"), "inf"),
])
def test_toml_value(value, text):
    assert toml_value(value) == text
    assert tomllib.loads(f"v = {text}")["v"] == value


def test_diff_changed_only_a_only_b(write):
    a = load_recipe(write("a.toml", "[training]\nsteps = 5\n"))
    b = load_recipe(write("b.toml", "[training]\nsteps = 6\n[model.attention]\nqk_norm = true\n"))
    d = diff(a, b)
    assert d.changed == {"training.steps": (5, 6), "model.attention.qk_norm": (False, True)}
    assert not d.equal
    text = d.render("a", "b")
    assert "[training]\n  ~ steps: 5 -> 6" in text
    # A component switched to another type shows keys only in one side.
    c = load_recipe(write("c.toml", '[optimizer.schedule]\ntype = "wsd"\n'))
    d2 = diff(a, c)
    assert "optimizer.schedule.decay_fraction" in d2.only_b
    assert d2.changed["optimizer.schedule.type"] == ("warmup_cosine", "wsd")


def test_run_name_and_folder_are_ignored_by_default(write):
    a = load_recipe(write("a.toml", "[training]\nsteps = 5\n"))
    b = load_recipe(write("b.toml", "[training]\nsteps = 5\n"))
    assert diff(a, b).equal
    assert not diff(a, b, ignore=()).equal


def test_cli_exit_codes_and_json(capsys, write):
    debug, llama = str(CONFIGS / "debug.toml"), str(CONFIGS / "llama_debug.toml")
    assert main(["diff", debug, debug]) == 0
    assert "identical" in capsys.readouterr().out
    assert main(["diff", debug, llama]) == 1
    out = capsys.readouterr().out
    assert "[model]" in out and "n_layers: 4 -> 6" in out
    assert main(["diff", debug, llama, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["changed"]["model.n_layers"] == {"a": 4, "b": 6}
    assert main(["diff", debug, "missing.toml"]) == 2


def test_diff_reads_run_folders(tmp_path, capsys):
    from kiln.recipes.config.files import to_toml

    run = tmp_path / "run"
    run.mkdir()
    recipe = load_recipe(CONFIGS / "debug.toml", ["--training.steps=3"])
    (run / "recipe.toml").write_text(to_toml(recipe))
    assert main(["diff", str(CONFIGS / "debug.toml"), str(run)]) == 1
    assert "steps: 300 -> 3" in capsys.readouterr().out


def test_a_resolved_recipe_of_the_release_before_the_rooms_loads_unchanged():
    """Run folders and checkpoints keep their resolved recipe.toml; one written before the hooks
    became a registered kind ([run.watchdog] without a type) resolves to today's recipe."""
    old = load_recipe(Path(__file__).parent / "data" / "debug_resolved_0.1.0.toml")
    assert not diff(old, load_recipe(CONFIGS / "debug.toml")).keys()
    assert old.run.watchdog.type == "watchdog" and old.run.routing.type == "routing"

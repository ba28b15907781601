"""scripts/fuzz_train.py: accepted mutations trained for two steps; a one-line refusal is
counted, a traceback is reported and sets the exit status."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import pytest

from tests.conftest import CONFIGS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fuzz_train.py"


def _script() -> dict:
    return runpy.run_path(str(SCRIPT))


def test_one_mutation_per_set_of_keys_the_most_extreme_first():
    pick = _script()["one_per_key"]
    mutations = [["--a.b=0.5"], ["--a.b=1e30"], ["--a.b=-1"], ["--c=\"abc\""],
                 ["--t=x", "--t.k=0"], ["--t=x", "--t.k=7"]]
    assert pick(mutations) == [["--a.b=1e30"], ["--c=\"abc\""], ["--t=x", "--t.k=0"]]


def test_mutations_of_the_run_folder_are_left_out():
    keep = _script()["own_keys_left_out"]
    assert keep([["--run.folder=\"abc\""], ["--run.name=\"x\""], ["--run.folder="]]) == [
        ["--run.name=\"x\""]]


def test_a_run_is_ok_refused_or_raw_by_its_status_and_stderr():
    classify = _script()["classify"]
    assert classify(0, "step 1/2 ...") == ("ok", "")
    assert classify(2, "notes\nkiln train: error: training.seed = -1: ...\n") == (
        "refused", "kiln train: error: training.seed = -1: ...")
    assert classify(1, "Traceback (most recent call last):\n  File x\nValueError: bad\n") == (
        "raw", "ValueError: bad")
    assert classify(-9, "") == ("refused", "exit status -9")


def test_raw_runs_are_printed_and_refusals_counted_once_a_message(tmp_path, capsys):
    script = _script()
    outcomes = {"--x=1": ("ok", ""), "--x=2": ("refused", "kiln train: error: no"),
                "--x=3": ("refused", "kiln train: error: no"), "--x=4": ("raw", "KeyError: 'k'")}
    script["main"].__globals__["train"] = lambda recipe, mutation, base, folder, timeout, _: (
        outcomes[mutation[0]])
    accepted = tmp_path / "accepted.json"
    accepted.write_text(json.dumps([[m] for m in outcomes]))
    assert script["main"](["r.toml", str(accepted), "--jobs", "1"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == ["RAW --x=4: KeyError: 'k'", "REFUSED x2: kiln train: error: no",
                   "4 mutations trained: 1 ok, 2 refused by train, 1 bug(s)"]


@pytest.mark.slow
def test_a_real_mutation_trains_for_two_steps(tmp_path, capsys):
    accepted = tmp_path / "accepted.json"
    accepted.write_text(json.dumps([["--optimizer.eps=0.5"], ["--training.max_hours=1"]]))
    small = ["--model.dim=32", "--model.n_layers=1", "--model.attention.n_heads=2",
             "--training.seq_len=32", "--training.global_batch=2", "--training.micro_batch=1"]
    status = _script()["main"]([str(CONFIGS / "debug.toml"), str(accepted),
                                *(f"--base={b}" for b in small)])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "checkpoint.enable = false" in out  # the base's own setting, counted as a refusal
    assert out.strip().endswith("2 mutations trained: 1 ok, 1 refused by train, 0 bug(s)"), out


def test_a_resume_must_say_it_resumed_and_list_each_change():
    resumed = _script()["resumed"]
    out = ("kiln: recipe changed since the checkpoint (allowed):\n  optimizer.eps: 1e-08 -> 0.5\n"
           "  training.steps: 2 -> 3\nkiln: resumed from RUN/checkpoints/step_0000002 at step 2\n")
    assert resumed(out, ["optimizer.eps"]) == ("ok", "")
    assert resumed(out, ["optimizer.eps", "data.prefetch"]) == (
        "raw", "resumed without listing data.prefetch")
    assert resumed("step 1/3 ...\n", []) == ("raw", "started over instead of resuming")


@pytest.mark.slow
def test_a_real_resume_of_each_mutation(tmp_path, capsys):
    """The run folder is trained once; each mutation resumes a copy of it."""
    from kiln.recipes.cli import main

    small = ["--model.dim=32", "--model.n_layers=1", "--model.attention.n_heads=2",
             "--training.seq_len=32", "--training.global_batch=2", "--training.micro_batch=1",
             "--eval.at_end=false", "--checkpoint.interval=2"]
    recipe = str(CONFIGS / "debug.toml")
    assert main(["train", recipe, *small, "--training.steps=2",
                 f"--run.folder={tmp_path / 'run'}"]) == 0
    accepted = tmp_path / "accepted.json"
    accepted.write_text(json.dumps([["--data.prefetch=4"], ["--model.dim=64"]]))
    capsys.readouterr()
    status = _script()["main"]([recipe, str(accepted), "--resume-from", str(tmp_path / "run"),
                                *(f"--base={b}" for b in [*small, "--training.steps=3"])])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "REFUSED x1: kiln train: error: RUN_FOLDER/checkpoints/step_0000002: the recipe " \
        "changed in ways this checkpoint cannot follow:" in out
    assert out.strip().endswith("2 mutations resumed: 1 ok, 1 refused by train, 0 bug(s)"), out

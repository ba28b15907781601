"""The `kiln` command line: help, list, show, validate, and every shipped recipe validating."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from kiln.recipes.cli import COMMANDS, main
from tests.conftest import CONFIGS, REPO


def shipped_recipes(folder=CONFIGS) -> list:
    """The recipes kiln ships: those git tracks in train_configs/ (a user's own recipe saved
    there, as the README suggests, is not the suite's to check); every one outside a git
    checkout."""
    listed = subprocess.run(["git", "ls-files", "--", "*.toml"], cwd=folder,
                            capture_output=True, text=True)
    if listed.returncode != 0:
        return sorted(folder.glob("*.toml"))
    return sorted(folder / name for name in listed.stdout.split() if "/" not in name)


SHIPPED = shipped_recipes()
HUB_DATA = {"nova_10b_dense.toml"}  # its data is on the Hub: validated without reading it
# its base is another recipe's export (docs/finetuning.md makes it; tests/recipes/
# test_dpo_recipe.py and docs/rl.md run the chains at toy size): validated from a random start
AFTER_ANOTHER = {name: ['--checkpoint.init_from=""'] for name in ("dpo_debug.toml",
                                                                  "grpo_debug.toml")}


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_help_says_what_each_command_takes(capsys):
    """The top-level line of eval names --tasks; train / validate usage shows the recipe
    overrides and NGPU; bench shows its defaults."""
    assert main(["--help"]) == 0
    eval_help = COMMANDS["eval"][1]
    assert "--tasks" in eval_help and "--loops" in eval_help
    assert f"eval {eval_help}" in " ".join(capsys.readouterr().out.split())
    for command in ("train", "validate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        out = capsys.readouterr().out
        assert "[--key=value ...]" in out.split("\n\n")[0] and "NGPU" in out
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "measured steps (default: 20)" in out and "(default: 3)" in out


def test_unknown_command_exits_2(capsys):
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_list_shows_builtins_with_fields(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for name in ("model:transformer", "attention:causal", "ffn:swiglu", "norm:rmsnorm",
                 "position:rope", "optimizer:adamw", "schedule:warmup_cosine", "schedule:wsd",
                 "dataset:packed_documents", "tokenizer:byte", "step:standard"):
        assert name in out
    assert "    theta: float = 10000.0" in out
    assert main(["list", "schedule"]) == 0
    assert "model:transformer" not in capsys.readouterr().out
    assert main(["list", "flavour"]) == 2


def test_show_prints_resolved_toml_with_overrides(capsys):
    assert main(["show", str(CONFIGS / "llama_debug.toml"), "--training.steps=7"]) == 0
    data = tomllib.loads(capsys.readouterr().out)
    assert data["training"]["steps"] == 7
    assert data["model"]["attention"]["position"]["theta"] == 500000.0


def test_a_top_level_override_reaches_the_recipe_and_a_misplaced_one_is_placed(capsys):
    """argparse said "unrecognized arguments: --description=x" for a top-level key and
    "--steps=3" (no dot) alike; both now reach the recipe loader."""
    assert main(["show", str(CONFIGS / "debug.toml"), "--description=hello"]) == 0
    assert 'description = "hello"' in capsys.readouterr().out
    assert main(["validate", str(CONFIGS / "debug.toml"), "--steps=3"]) == 2
    assert "unknown key steps (did you mean training.steps?)" in capsys.readouterr().out
    assert main(["validate", str(CONFIGS / "debug.toml"), "--interval=3"]) == 2
    assert "(did you mean eval.interval or checkpoint.interval?)" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # argparse's exit status 2, with the form to write
        main(["validate", str(CONFIGS / "debug.toml"), "--steps", "3"])
    assert ("unrecognized arguments: --steps 3; recipe overrides are one word each, "
            "--section.key=value") in capsys.readouterr().err
    # a command's own --option=value is still its own
    import argparse

    from kiln.recipes.cli import _split_overrides

    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", action="append")
    parser.add_subparsers().add_parser("prepare").add_argument("--out")  # kiln data prepare
    assert _split_overrides(parser, ["prepare", "--out=x", "--grid=a.b=1,2", "--seed=3"]) == (
        ["--seed=3"], ["prepare", "--out=x", "--grid=a.b=1,2"])


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_recipe_validates_without_notes(path, capsys):
    status = main(["validate", str(path), *(["--no-data"] if path.name in HUB_DATA else []),
                   *AFTER_ANOTHER.get(path.name, [])])
    out, err = capsys.readouterr()
    assert status == 0, out
    assert "parameters:" in out
    assert err == ""  # no "note: ... dropped" for a recipe kiln ships


def test_the_shipped_recipes_are_the_tracked_ones_not_a_users_own(tmp_path):
    assert {"debug.toml", "sft_debug.toml", "mixture_debug.toml"} <= {p.name for p in SHIPPED}
    for name in ("debug.toml", "my_recipe.toml"):
        (tmp_path / name).write_text("[training]\nsteps = 3\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "debug.toml"], cwd=tmp_path, check=True)
    assert shipped_recipes(tmp_path) == [tmp_path / "debug.toml"]


def test_validate_reports_invalid_recipes(write, capsys):
    bad = write("bad.toml", "[model]\ndim = -1\n[model.attention]\nn_heads = 3\n")
    assert main(["validate", str(bad)]) != 0
    assert "INVALID" in capsys.readouterr().out


def test_validate_checks_the_batch_plan_like_train(capsys, monkeypatch):
    """Issue 10 item 7: validate said "ok" to a batch plan that `kiln train` refuses."""
    monkeypatch.delenv("NGPU", raising=False)
    args = ["validate", str(CONFIGS / "debug.toml"), "--training.global_batch=7",
            "--training.micro_batch=2"]
    assert main(args) == 2
    out = capsys.readouterr().out
    assert "INVALID" in out and "training.global_batch" in out and "training.micro_batch" in out
    assert main(["validate", str(CONFIGS / "debug.toml"), "--world-size", "3"]) == 2
    assert "not divisible by the world size 3" in capsys.readouterr().out
    assert main(["validate", str(CONFIGS / "debug.toml")]) == 0
    assert "budget: 300 steps x 2,048 tokens/step" in capsys.readouterr().out


@pytest.mark.slow
def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "kiln.recipes.cli", "show",
                          str(CONFIGS / "debug.toml"), "--training.seed=5"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0 and "seed = 5" in out.stdout


def test_parameter_counts_print_with_a_unit():
    from kiln.recipes.commands.validate import human_count

    assert [human_count(n) for n in (999, 35_488, 999_999, 3_476_224, 7_902_000_000)] == [
        "999", "35.5K", "1.00M", "3.48M", "7.90B"]


def test_validate_prints_millions_for_the_debug_recipe(capsys):
    assert main(["validate", str(CONFIGS / "debug.toml")]) == 0
    out = capsys.readouterr().out
    assert "parameters: 3,492,096 (3.49M)" in out  # byte vocabulary 258 padded to 320
    assert "28/10" in out  # 9 norm weights and the (tied) embedding are not decayed


@pytest.mark.parametrize("command", [["generate", "{}", "--prompt", "x"], ["eval", "{}"],
                                     ["export", "{}", "{}-out"]])
def test_checkpoint_commands_name_the_folder_not_a_recipe_key(tmp_path, capsys, command):
    """The folder given to generate / eval / export is an argument, not checkpoint.resume."""
    missing, empty = tmp_path / "runs" / "missing", tmp_path / "runs" / "empty"
    empty.mkdir(parents=True)
    for folder, says in ((missing, "does not exist"), (empty, "holds no checkpoint")):
        assert main([w.format(folder) for w in command]) == 2
        err = capsys.readouterr().err
        assert "checkpoint.resume" not in err and "resume =" not in err
        assert f"{folder} {says}" in err and "run folder" in err, err


def test_a_missing_resume_folder_names_the_key(tmp_path):
    from kiln.checkpointing import resume
    from kiln.components.errors import CheckpointError

    with pytest.raises(CheckpointError) as info:
        resume.resolve(str(tmp_path / "missing"), tmp_path / "own")
    assert "checkpoint.resume" in str(info.value) and "does not exist" in str(info.value)


def test_a_missing_data_path_suggests_preparing_from_text(write, capsys):
    path = write("r.toml", '[data]\npath = "no/such/data"\n[training]\nsteps = 1\n')
    assert main(["train", str(path)]) == 1
    err = capsys.readouterr().err
    assert "data.path = 'no/such/data'" in err
    assert "kiln data prepare RECIPE --input FILE_OR_FOLDER... --out no/such/data" in err


def test_train_joins_the_process_group_with_the_recipes_timeout_and_flight_recorder(
        monkeypatch, tmp_path):
    """The first init is the one that counts: a later one (the trainer's) finds the group up."""
    import datetime
    import os

    import torch.distributed as dist

    from kiln.recipes.runs import lock as run_lock

    class Joined(Exception):
        pass

    seen = {}

    def init_process_group(**kw):
        seen.update(join=kw["timeout"], fr=os.environ.get("TORCH_FR_BUFFER_SIZE"))

    def hold_run_folder(folder, world):
        raise Joined  # the next thing train does: the group is set up by now

    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "KILN_ERROR_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(dist, "is_initialized", lambda: "join" in seen)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist.distributed_c10d, "_set_pg_timeout",
                        lambda timeout, group=None: seen.update(collectives=timeout))
    monkeypatch.setattr(run_lock, "hold_run_folder", hold_run_folder)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: seen.update(left=True))
    with pytest.raises(Joined):
        main(["train", str(CONFIGS / "debug.toml"), "--parallelism.collective_timeout_s=5",
              "--parallelism.flight_recorder=50", f"--run.folder={tmp_path / 'r'}"])
    # joining waits longer (ranks start seconds apart); every collective after it 5 s
    assert seen["join"] == datetime.timedelta(seconds=600)
    assert seen.get("collectives", seen["join"]).total_seconds() == 5 and seen["fr"] == "50"


def test_version_names_kiln_git_and_torch(capsys):
    from importlib import metadata

    assert main(["--version"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"kiln {metadata.version('kiln')} (git ") and "torch 2." in out

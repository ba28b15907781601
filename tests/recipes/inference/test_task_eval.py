"""`kiln eval RUN --tasks ...`: a run's tasks, a chosen step, a task file, a Hugging Face folder,
--list-tasks and --json; the scores equal the training loop's for the same checkpoint."""

from __future__ import annotations

import json

import pytest

from kiln.recipes.cli import main
from tests.components.tasks import samples
from tests.recipes.hooks.test_downstream import metrics_of, task_flags
from tests.recipes.test_combinations import recipe_for, train


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("evalrun")
    train(recipe_for("dense", folder / "run", "--training.steps=4", "--checkpoint.enable=true",
                     "--checkpoint.interval=2", *task_flags(folder)))
    return folder


def test_tasks_of_the_run_equal_the_training_loop_scores(run, capsys):
    assert main(["eval", str(run / "run"), "--tasks", "all", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"].endswith("step_0000004")
    logged = metrics_of(run / "run")[4]
    for name, r in result["tasks"].items():
        for metric, value in r["metrics"].items():
            assert value == pytest.approx(logged[f"eval/{name}/{metric}"], abs=1e-12), metric
    assert main(["eval", str(run / "run"), "--tasks", "mc", "--step", "2", "--json"]) == 0
    step2 = json.loads(capsys.readouterr().out)
    assert step2["model"].endswith("step_0000002") and list(step2["tasks"]) == ["mc"]
    assert step2["tasks"]["mc"]["metrics"]["acc"] == pytest.approx(
        metrics_of(run / "run")[2]["eval/mc/acc"], abs=1e-12)


def test_table_limit_list_and_errors(run, capsys):
    assert main(["eval", str(run / "run"), "--tasks", "mc,bpb", "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert "mc               acc" in out and "bits_per_byte" in out and "        3" in out
    assert main(["eval", str(run / "run"), "--list-tasks"]) == 0
    out = capsys.readouterr().out
    assert "multiple_choice" in out and "gsm8k" in out and "  mc " in out
    assert main(["eval", str(run / "run"), "--tasks", "mcc"]) == 2
    assert "unknown task 'mcc' (did you mean 'mc'?)" in capsys.readouterr().err
    assert main(["eval", str(run / "run"), "--tasks", "mc", "--step", "3"]) == 2
    assert "no complete checkpoint of step 3; steps there: 2, 4" in capsys.readouterr().err
    assert main(["eval", "--tasks", "mc"]) == 2
    assert main(["eval", str(run / "run"), "--pending"]) == 2
    assert "nothing is pending" in capsys.readouterr().err
    assert main(["eval", str(run / "typo"), "--pending"]) == 2  # said "nothing is pending"
    assert f"{run / 'typo'}: no such folder" in capsys.readouterr().err


def test_a_hugging_face_folder_with_a_task_file(tmp_path, capsys, write):
    from tests.checkpointing.huggingface.hf_tiny import save_tiny

    save_tiny(tmp_path / "hf", vocab_size=300)
    data = samples.write_jsonl(tmp_path / "t.jsonl", samples.rows(5))
    tasks = write("tasks.toml", f'[evals.mc]\ntype = "multiple_choice"\npath = "{data}"\n')
    assert main(["eval", str(tmp_path / "hf"), "--tasks", "mc", "--task-file", str(tasks),
                 "--json", "--evals.mc.limit=2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tasks"]["mc"]["examples"] == 2
    bad = write("bad.toml", '[evals.mc]\ntype = "multiple_choice"\npth = "x"\n')
    assert main(["eval", str(tmp_path / "hf"), "--tasks", "mc", "--task-file", str(bad)]) == 2
    assert "bad.toml: unknown key evals.mc.pth (did you mean 'path'?)" in capsys.readouterr().err


def test_kiln_s_own_export_is_a_hugging_face_folder_to_evaluate(run, capsys, write):
    """The export carries recipe.toml beside config.json + safetensors: still a model folder."""
    export = run / "export"
    assert main(["export", str(run / "run" / "checkpoints" / "step_0000004"), str(export)]) == 0
    capsys.readouterr()
    assert (export / "recipe.toml").is_file()
    data = run / "tasks.jsonl"
    tasks = write("tasks.toml", f'[evals.mc]\ntype = "multiple_choice"\npath = "{data}"\n'
                  f'num_fewshot = 1\n[evals.bpb]\ntype = "bits_per_byte"\npath = "{data}"\n')
    assert main(["eval", str(export), "--tasks", "all", "--task-file", str(tasks),
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["model"] == str(export)
    logged = metrics_of(run / "run")[4]
    assert result["tasks"]["mc"]["metrics"]["acc"] == logged["eval/mc/acc"]
    assert result["tasks"]["bpb"]["metrics"]["bits_per_byte"] == pytest.approx(
        logged["eval/bpb/bits_per_byte"], rel=1e-6)
    assert main(["eval", str(export), "--list-tasks"]) == 0
    assert "multiple_choice" in capsys.readouterr().out


@pytest.mark.parametrize("request_, message", [
    ({"step": 2, "checkpoint": 5, "tasks": {"mc": {}}}, "checkpoint is 5, not a path"),
    ({"step": "two", "checkpoint": "c", "tasks": {"mc": {}}}, "step is 'two', not a number"),
    ({"step": 2, "checkpoint": "c", "tasks": ["mc"]}, "tasks is ['mc'], not a table"),
    ({"step": 2, "checkpoint": "checkpoints/step_0000002", "tasks": {"mc": {}}},
     "the snapshot of step 2, checkpoints/step_0000002, is gone"),
])
def test_a_damaged_or_stale_request_is_one_error_naming_it(tmp_path, capsys, request_, message):
    if isinstance(request_["tasks"], dict):
        request_["tasks"] = {"mc": {"type": "multiple_choice", "path": "tasks.jsonl"}}
    (tmp_path / "pending_downstream_eval.json").write_text(json.dumps(request_))
    assert main(["eval", str(tmp_path), "--pending"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert f"{tmp_path / 'pending_downstream_eval.json'}: " in err

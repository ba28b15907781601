"""[evals.NAME] tasks in the training loop: scores in metrics.jsonl at each interval and at the
end; training losses bit-identical with and without them; pause mode saves, writes the request,
exits and resumes exactly; bad task data stops a run before its first step."""

from __future__ import annotations

import io
import json

import pytest

from kiln.components.errors import DataError, RecipeError
from tests.components.tasks import samples
from tests.recipes.test_combinations import recipe_for, train

STEPS = 4


def task_flags(folder, interval: int = 2, mode: str = "inline", path=None) -> list[str]:
    """A multiple-choice, an exact-match and a bits-per-byte task on small files."""
    data = samples.rows(6)
    path = path or samples.write_jsonl(folder / "tasks.jsonl", data)
    flags = []
    for name, kind, extra in (
        ("mc", "multiple_choice", ["--evals.mc.num_fewshot=1"]),
        ("em", "exact_match", ["--evals.em.max_new_tokens=4", "--evals.em.batch_size=4"]),
        ("bpb", "bits_per_byte", []),
    ):
        flags += [f"--evals.{name}.type={kind}", f"--evals.{name}.path='{path}'",
                  f"--evals.{name}.interval={interval}", f"--evals.{name}.mode={mode}", *extra]
    return flags


def metrics_of(folder) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rec = json.loads(line)
        out.setdefault(rec["step"], {}).update(rec)
    return out


def test_scores_at_every_interval_and_training_unchanged(tmp_path):
    plain, _ = train(recipe_for("dense", tmp_path / "plain", f"--training.steps={STEPS}"))
    losses, trainer = train(recipe_for("dense", tmp_path / "evals", f"--training.steps={STEPS}",
                                       *task_flags(tmp_path)))
    assert losses == plain  # bit-identical
    seen = metrics_of(tmp_path / "evals")
    for step in (2, 4):
        assert {"eval/mc/acc", "eval/mc/acc_norm", "eval/mc/acc_bytes", "eval/em/exact_match",
                "eval/bpb/bits_per_byte"} <= set(seen[step]), seen[step]
        assert 0 <= seen[step]["eval/mc/acc"] <= 1 and seen[step]["eval/bpb/bits_per_byte"] > 0
    assert "eval/mc/acc" not in seen.get(1, {}) and "eval/mc/acc" not in seen.get(3, {})
    assert trainer.model.training  # handed back in training mode


def test_pause_mode_saves_hands_over_and_resumes_exactly(tmp_path, capsys):
    straight, _ = train(recipe_for("dense", tmp_path / "straight", f"--training.steps={STEPS}",
                                   "--checkpoint.enable=true", "--checkpoint.interval=0"))
    args = (f"--training.steps={STEPS}", "--checkpoint.enable=true", "--checkpoint.interval=0",
            *task_flags(tmp_path, mode="pause"), "--evals.inline.type=multiple_choice",
            f"--evals.inline.path='{tmp_path / 'tasks.jsonl'}'", "--evals.inline.interval=2")
    run = tmp_path / "paused"
    out = io.StringIO()
    first, _ = train(recipe_for("dense", run, *args), out=out)
    assert len(first) == 2 and "downstream evaluation of step 2 (mc, em, bpb) is pending" \
        in out.getvalue()
    pending = json.loads((run / "pending_downstream_eval.json").read_text())
    assert pending["step"] == 2 and pending["checkpoint"].endswith("step_0000002")
    assert set(pending["tasks"]) == {"mc", "em", "bpb"}
    # a scheduler evaluates the snapshot elsewhere (here: kiln eval --pending)
    from kiln.recipes.cli import main

    assert main(["eval", str(run), "--pending", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done[0]["step"] == 2 and set(done[0]["tasks"]) == {"mc", "em", "bpb"}
    assert not (run / "pending_downstream_eval.json").exists()
    assert json.loads((run / "downstream_eval.jsonl").read_text())["step"] == 2
    second, _ = train(recipe_for("dense", run, *args))  # the same command: resumes at step 2
    assert first + second == straight
    assert json.loads((run / "pending_downstream_eval.json").read_text())["step"] == STEPS
    seen = metrics_of(run)
    assert "eval/inline/acc" in seen[2] and "eval/inline/acc" in seen[4]


def test_pause_needs_checkpoints(tmp_path):
    with pytest.raises(RecipeError, match=r"evals.mc.mode = \"pause\" saves a snapshot"):
        train(recipe_for("dense", tmp_path / "r", *task_flags(tmp_path, mode="pause")))


def test_bad_task_data_stops_the_run_before_its_first_step(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match=f"task 'mc': file {missing} not found"):
        train(recipe_for("dense", tmp_path / "r", *task_flags(tmp_path, path=missing)))
    assert not (tmp_path / "r").exists()  # nothing trained, nothing written
    bad = samples.write_jsonl(tmp_path / "bad.jsonl",
                              [{"context": "a", "choices": ["x", "y"], "answer": 3}])
    with pytest.raises(DataError, match=r"task 'mc': .*bad.jsonl: example 0 \(the file's "
                                        r"1st\): answer 3 is out of range"):
        train(recipe_for("dense", tmp_path / "r", *task_flags(tmp_path, path=bad)))


class Killed(BaseException):
    """kill -9 at a chosen moment (nothing of the process runs after it but its cleanup)."""


def test_pause_killed_at_each_publish_scores_every_step_exactly_once(tmp_path, monkeypatch,
                                                                     capsys):
    """A pause killed after its snapshot is published and before the request is written: the
    resume asks again for its own step. A `kiln eval --pending` killed after appending a result
    and before removing the request: the rerun does not score it twice."""
    from kiln.recipes.cli import main
    from kiln.recipes.hooks import downstream

    path = samples.write_jsonl(tmp_path / "tasks.jsonl", samples.rows(6))
    run = tmp_path / "paused"
    args = (f"--training.steps={STEPS}", "--checkpoint.enable=true", "--checkpoint.interval=0",
            "--evals.mc.type=multiple_choice", f"--evals.mc.path='{path}'",
            "--evals.mc.interval=2", "--evals.mc.mode=pause")
    write_pending = downstream.write_pending

    def killed(*a, **kw):
        raise Killed

    for step in (2, 4):  # each killed run trains on to its next pause
        monkeypatch.setattr(downstream, "write_pending", killed)
        with pytest.raises(Killed):
            train(recipe_for("dense", run, *args))
        assert (run / "checkpoints" / f"step_000000{step}").is_dir()
        assert not (run / "pending_downstream_eval.json").exists()  # lost with the process
        monkeypatch.setattr(downstream, "write_pending", write_pending)
        losses, _ = train(recipe_for("dense", run, *args))  # the same command again
        assert losses == [] and json.loads(
            (run / "pending_downstream_eval.json").read_text())["step"] == step
        request = (run / "pending_downstream_eval.json").read_text()
        if step == 4:  # the task file edited after the pause: scored, with a warning
            samples.write_jsonl(path, samples.rows(7))
        capsys.readouterr()
        assert main(["eval", str(run), "--pending"]) == 0
        assert ("'mc': " + f"{path} changed since step 4 paused" in capsys.readouterr().err) \
            is (step == 4)
        (run / "pending_downstream_eval.json").write_text(request)  # killed before the unlink
        assert main(["eval", str(run), "--pending"]) == 0
        assert not (run / "pending_downstream_eval.json").exists()
    scored = [json.loads(line) for line in (run / "downstream_eval.jsonl").read_text()
              .splitlines()]
    assert [(r["step"], list(r["tasks"])) for r in scored] == [(2, ["mc"]), (4, ["mc"])]
    losses, _ = train(recipe_for("dense", run, *args))  # finished, and nothing owed
    assert losses == [] and not (run / "pending_downstream_eval.json").exists()


def test_rotation_keeps_a_snapshot_with_a_pending_evaluation(tmp_path):
    """keep_last = 1 and a save every step: the paused step's snapshot stays until scored."""
    from kiln.recipes.cli import main

    path = samples.write_jsonl(tmp_path / "tasks.jsonl", samples.rows(6))
    run = tmp_path / "r"
    args = (f"--training.steps={STEPS}", "--checkpoint.enable=true", "--checkpoint.interval=1",
            "--checkpoint.keep_last=1", "--evals.mc.type=multiple_choice",
            f"--evals.mc.path='{path}'", "--evals.mc.interval=2", "--evals.mc.mode=pause")
    train(recipe_for("dense", run, *args))  # pauses at step 2
    train(recipe_for("dense", run, *args))  # on without evaluating: saves 3, pauses at 4
    assert (run / "checkpoints" / "step_0000002").is_dir()
    assert main(["eval", str(run), "--pending"]) == 0
    assert [json.loads(line)["step"] for line in
            (run / "downstream_eval.jsonl").read_text().splitlines()] == [2, 4]

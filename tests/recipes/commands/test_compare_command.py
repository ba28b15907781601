"""`kiln compare` and the run reader under it: differing recipe keys beside the results, sorting,
JSON / Markdown, resumed runs' re-logged steps, and the messages for what is not a run."""

from __future__ import annotations

import json

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.cli import main
from kiln.recipes.config.diff import differing, short_names
from kiln.recipes.runs.read import open_run, read_jsonl, series, summary
from tests.recipes.run_folders import make_run


def test_differing_keys_and_their_short_names(tmp_path):
    a = make_run(tmp_path / "a", ("--optimizer.lr=1e-3",))
    b = make_run(tmp_path / "b", ("--optimizer.lr=3e-3", "--model.ffn.hidden_dim=512"))
    diffs = differing([open_run(a).recipe, open_run(b).recipe])
    assert diffs == {"model.ffn.hidden_dim": [768, 512], "optimizer.lr": [1e-3, 3e-3]}
    assert short_names(["optimizer.lr", "model.dim", "model.ffn.dim"]) == {
        "optimizer.lr": "lr", "model.dim": "model.dim", "model.ffn.dim": "ffn.dim"}


def test_summary_final_best_eval_speed(tmp_path):
    run = open_run(make_run(tmp_path / "a", losses=(3.0, 1.5, 2.0), evals=(2.6, 2.2)))
    s = summary(run)
    assert (s["steps"], s["final_loss"], s["best_loss"]) == (30, 2.0, 1.5)
    assert (s["eval_loss"], s["best_eval_loss"], s["eval_bpb"]) == (2.2, 2.2, 1.1)
    assert s["tokens_per_second"] == 2500.0  # median without the first (warm-up) line
    assert s["wall_clock_s"] == 6.0 and s["mfu"] == 0.1


def test_compare_table_text_markdown_json_and_sort(tmp_path, capsys):
    a = make_run(tmp_path / "lr1", ("--optimizer.lr=1e-3",), losses=(3.0, 2.0))
    b = make_run(tmp_path / "lr3", ("--optimizer.lr=3e-3",), losses=(3.0, 1.0))
    assert main(["compare", str(a), str(b)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:5] == ["run", "lr", "steps", "final", "loss"]
    assert lines[1].split()[:4] == ["lr1", "0.001", "20", "2.0000"]
    assert main(["compare", str(a), str(b), "--sort=final_loss"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("lr3")
    assert main(["compare", str(a), str(b), "--sort", "final loss", "--markdown"]) == 0
    md = capsys.readouterr().out.splitlines()
    assert md[0].startswith("| run | lr | steps |") and md[2].startswith("| lr3 | 0.003 |")
    assert main(["compare", str(a), str(b), "--json", "--sort=-lr"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["run"] for r in rows] == ["lr3", "lr1"] and rows[0]["final_loss"] == 1.0
    assert main(["compare", str(a), "--sort=nope"]) == 2
    assert "no such column; columns: run, steps" in capsys.readouterr().err


def test_an_rl_runs_reward_is_the_mean_of_its_last_ten_logged_values(tmp_path, capsys):
    """A GRPO run's loss says little; its reward (one batch's each step) is averaged."""
    runs = []
    for name, base in (("low", 0.0), ("high", 0.5)):
        folder = make_run(tmp_path / name, losses=(0.0,) * 12, evals=())
        lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
        for i, line in enumerate(lines):
            line["reward"] = base + i / 100  # rises over 12 lines
        (folder / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        runs.append(str(folder))
    assert summary(open_run(runs[0]))["reward"] == pytest.approx(sum(range(2, 12)) / 1000)
    assert main(["compare", *runs, "--sort=-reward"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "reward (last 10)" in out[0] and out[1].startswith("high")
    assert "0.5650" in out[1] and "0.0650" in out[2]
    plain = make_run(tmp_path / "plain")
    assert main(["compare", str(plain)]) == 0 and "reward" not in capsys.readouterr().out


def test_not_a_run_no_metrics_and_missing_folder(tmp_path, capsys):
    (tmp_path / "holder" / "inner").mkdir(parents=True)
    make_run(tmp_path / "holder" / "inner")
    assert main(["compare", str(tmp_path / "holder")]) == 2
    err = capsys.readouterr().err
    assert "not a run folder (no recipe.toml); runs inside it: inner" in err
    assert main(["compare", str(tmp_path / "gone")]) == 2
    assert "no such folder" in capsys.readouterr().err
    empty = make_run(tmp_path / "empty")
    (empty / "metrics.jsonl").unlink()
    with pytest.raises(RecipeError, match="no metrics yet \\(no metrics.jsonl\\)"):
        open_run(empty)


def test_resumed_run_relogs_steps_and_torn_last_line(tmp_path, capsys):
    lines = [{"step": 10, "loss": 3.0}, {"step": 20, "loss": 2.5}, {"step": 30, "loss": 2.4},
             {"step": 20, "loss": 2.6}, {"step": 30, "loss": 2.3}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 40, "lo')
    kept = read_jsonl(path)
    assert [(r["step"], r["loss"]) for r in kept] == [(10, 3.0), (20, 2.6), (30, 2.3)]
    assert capsys.readouterr().err == ""  # a torn last line is expected after a kill
    path.write_text('garbage\n{"step": 1, "loss": 1.0}\n')
    assert len(read_jsonl(path)) == 1
    assert "metrics.jsonl:1: not a metrics line" in capsys.readouterr().err


def test_non_utf8_bytes_cost_their_line_only_in_compare_and_plot(tmp_path, capsys):
    """A metrics.jsonl with damaged bytes: the bad line is left out with a warning, the rest
    compares and plots (it stopped with UnicodeDecodeError)."""
    run = make_run(tmp_path / "a", losses=(3.0, 2.0, 1.5))
    metrics = run / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(lines[0] + b'{"step": 15, "loss": "\xff\xfe"}\n' + b"".join(lines[1:]))
    assert main(["compare", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "metrics.jsonl:2: not UTF-8 text, left out" in err and "1.5000" in out
    pytest.importorskip("matplotlib")
    assert main(["plot", str(run), "--out", str(tmp_path / "p.png")]) == 0
    assert (tmp_path / "p.png").stat().st_size > 0


def test_series_x_axes(tmp_path):
    run = open_run(make_run(tmp_path / "a", losses=(3.0, 2.0, 1.0), evals=(2.0,)))
    assert series(run, "loss", "tokens") == ([20480.0, 40960.0, 61440.0], [3.0, 2.0, 1.0])
    assert series(run, "loss", "time")[0] == [2.0, 4.0, 6.0]
    assert series(run, "eval/loss", "tokens") == ([61440.0], [2.0])  # from the train lines


def test_eval_lines_of_several_tasks_at_one_step_all_survive(tmp_path):
    """In-loop tasks log one line each at the same step: none of them is a resumed session."""
    lines = [{"step": 10, "loss": 3.0}, {"step": 10, "eval/loss": 2.9},
             {"step": 10, "eval/mc/acc": 0.3, "eval/mc/acc_norm": 0.3},
             {"step": 10, "eval/em/exact_match": 0.0},
             {"step": 20, "loss": 2.0}, {"step": 20, "eval/loss": 2.1},
             {"step": 20, "eval/mc/acc": 0.4, "eval/mc/acc_norm": 0.4},
             {"step": 20, "eval/em/exact_match": 0.1}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert read_jsonl(path) == lines
    # an old file without session markers: a resumed session re-logging step 20 still wins
    again = [{"step": 20, "loss": 1.9}, {"step": 20, "eval/loss": 2.05},
             {"step": 20, "eval/mc/acc": 0.5, "eval/mc/acc_norm": 0.5}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines + again))
    kept = read_jsonl(path)
    assert [r for r in kept if r["step"] == 20] == [{"step": 20, "eval/em/exact_match": 0.1},
                                                    *again]


def test_session_marker_drops_what_the_earlier_session_logged_after_its_checkpoint(tmp_path):
    """A session's first line says where it resumed from: the earlier session's later lines go,
    whatever their keys (here a task the resumed session no longer runs)."""
    lines = [{"step": 10, "loss": 3.0, "session": {"from_step": 0}},
             {"step": 20, "loss": 2.5}, {"step": 20, "eval/old/acc": 0.2},
             {"step": 30, "loss": 2.4}, {"step": 30, "eval/old/acc": 0.3},
             {"step": 30, "loss": 2.2, "session": {"from_step": 20}},
             {"step": 30, "eval/new/acc": 0.6}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    kept = read_jsonl(path)
    assert [(r["step"], sorted(set(r) - {"step", "session"})) for r in kept] == [
        (10, ["loss"]), (20, ["loss"]), (20, ["eval/old/acc"]), (30, ["loss"]),
        (30, ["eval/new/acc"])]
    run = make_run(tmp_path / "run")
    (run / "metrics.jsonl").write_text(path.read_text())
    assert "session" not in open_run(run).metric_keys()


def test_plot_and_compare_see_every_task_line(tmp_path, capsys):
    run = make_run(tmp_path / "r", evals=())
    with (run / "metrics.jsonl").open("a") as f:
        for step in (10, 20, 30):
            for line in ({"eval/loss": 3.0 - step / 100}, {"eval/mc/acc": step / 100}):
                f.write(json.dumps({"step": step, **line}) + "\n")
    assert series(open_run(run), "eval/loss") == ([10.0, 20.0, 30.0], [2.9, 2.8, 2.7])
    assert main(["compare", str(run), "--json"]) == 0
    row = json.loads(capsys.readouterr().out)[0]
    assert (row["eval_loss"], row["best_eval_loss"]) == (2.7, 2.7)


MC = ("--evals.mc.type=multiple_choice", "--evals.mc.path=mc.jsonl", "--evals.mc.interval=10")
EM = ("--evals.em.type=exact_match", "--evals.em.path=em.jsonl")


def _log(run, *lines) -> None:
    with (run / "metrics.jsonl").open("a") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)


def test_compare_shows_one_column_per_task_from_either_source(tmp_path, capsys):
    """In-loop tasks log eval/<task>/<metric>; pause-mode results are in downstream_eval.jsonl.
    Either way one column per task: its headline metric (acc, exact_match) at the last step."""
    a = make_run(tmp_path / "a", ("--optimizer.lr=1e-3", *MC, *EM))
    _log(a, {"step": 10, "eval/mc/acc": 0.3, "eval/mc/acc_norm": 0.9, "eval/mc/acc_bytes": 0.9},
         {"step": 30, "eval/mc/acc": 0.5, "eval/mc/acc_norm": 0.1, "eval/mc/acc_bytes": 0.1},
         {"step": 30, "eval/em/exact_match": 0.25})
    b = make_run(tmp_path / "b", ("--optimizer.lr=3e-3", *MC, *EM, "--evals.mc.mode=pause",
                                  "--evals.em.mode=pause", "--checkpoint.enable=true"))
    (b / "downstream_eval.jsonl").write_text("".join(json.dumps(x) + "\n" for x in [
        {"step": 10, "checkpoint": "checkpoints/step_0000010", "tasks": {
            "mc": {"type": "multiple_choice", "metrics": {"acc": 0.4, "acc_norm": 0.2,
                                                          "acc_bytes": 0.2}}}},
        {"step": 30, "checkpoint": "checkpoints/step_0000030", "tasks": {
            "mc": {"type": "multiple_choice", "metrics": {"acc": 0.7, "acc_norm": 0.2,
                                                          "acc_bytes": 0.2}},
            "em": {"type": "exact_match", "metrics": {"exact_match": 0.5}}}}]))
    assert main(["compare", str(a), str(b), "--width", "0"]) == 0
    header, row_a, row_b = capsys.readouterr().out.splitlines()
    assert "mc acc" in header and "em exact_match" in header
    assert "acc_norm" not in header and "evals." not in header  # one column per task
    assert header.index("em exact_match") < header.index("mc acc")  # by name
    assert row_a.split()[-7:-3] == ["2.4000", "1.2000", "0.2500", "0.5000"]
    assert row_b.split()[-7:-3] == ["2.4000", "1.2000", "0.5000", "0.7000"]
    assert main(["compare", str(a), str(b), "--sort=-mc acc", "--width", "0"]) == 0
    assert capsys.readouterr().out.splitlines()[1].startswith("b ")
    assert main(["compare", str(a), str(b), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["task/mc"] for r in rows] == [0.5, 0.7] and rows[0]["task/em"] == 0.25


def test_compare_with_different_evals_tables_stays_one_line_per_run(tmp_path, capsys):
    """Different [evals] tables: one evals column naming what differs (escaped, no raw
    newlines), not a column per sub-key; training.steps is not a second 'steps' column."""
    a = make_run(tmp_path / "a", ("--training.steps=30", *MC))
    b = make_run(tmp_path / "b", ("--training.steps=40", *MC, *EM,
                                  "--evals.mc.fewshot_separator=\"\\n##\\n\"",
                                  "--evals.mc.num_fewshot=2"), losses=(3.0, 2.5, 2.0, 1.8))
    assert main(["compare", str(a), str(b), "--width", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    headers = lines[0].split("  ")
    headers = [h.strip() for h in headers if h.strip()]
    assert len(headers) == len(set(headers)) and "training.steps" in headers
    assert "evals" in headers and not any(h.startswith("evals.") for h in headers)
    assert "mc.num_fewshot=2" in lines[2] and "\\n##\\n" in lines[2] and "em" in lines[2]


def test_a_mixtures_per_source_evals_are_columns_not_tasks(tmp_path, capsys):
    """eval/loss/NAME (a mixture's per-source eval) is one column per source, never a task
    named "loss"; plot's default panels draw the per-source keys a line each."""
    from kiln.recipes.runs.plots import group_panels, resolve_metrics

    runs = []
    for name, code in (("a", 2.5), ("b", 2.0)):
        run = make_run(tmp_path / name, (f"--optimizer.lr={code / 1000}",))
        _log(run, {"step": 30, "eval/loss/code": code, "eval/loss/prose": 3.0,
                   "eval/bpb/code": code / 2},
             {"step": 30, "train/loss/code": code + 0.1, "data/share/code": 0.6,
              "data/share/prose": 0.4})
        runs.append(run)
    assert main(["compare", *map(str, runs), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["source/code"] for r in rows] == [2.5, 2.0]
    assert not any(k.startswith("task/") for r in rows for k in r)
    assert main(["compare", *map(str, runs), "--sort=code eval", "--width", "0"]) == 0
    header, first, _ = capsys.readouterr().out.splitlines()
    assert "code eval" in header and "prose eval" in header and first.startswith("b ")
    keys = resolve_metrics([open_run(r) for r in runs], None)
    assert group_panels(keys) == [
        ("loss", ["loss"]), ("eval/loss", ["eval/loss"]),  # the overall eval: its own panel
        ("train/loss", ["train/loss/code"]),
        ("eval/loss", ["eval/loss/code", "eval/loss/prose"]),  # "eval/loss per source"
        ("data/share", ["data/share/code", "data/share/prose"]),
        ("lr/main", ["lr/main"]), ("grad_norm", ["grad_norm"])]

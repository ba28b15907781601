"""Judgments with error bars: standard errors, paired and unpaired tests, the marks and notes of
`kiln compare`, the sweep's verdict, and a table that stays within 120 columns."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kiln.recipes.cli import main
from kiln.recipes.commands.compare import report, verdicts
from kiln.recipes.runs import significance, unit_scores
from tests.recipes.run_folders import make_run

stats = pytest.importorskip("scipy.stats")


def test_the_paired_test_is_scipys_and_a_shift_without_spread_is_certain():
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2, 200).astype(float)
    b = np.where(rng.random(200) < 0.1, 1 - a, a)
    got = significance.paired(a, b)
    assert got.p == pytest.approx(stats.ttest_rel(a, b).pvalue) and got.how == "paired t, n=200"
    assert significance.paired(a, a).p == 1.0 and significance.paired(a + 1, a).p == 0.0
    assert significance.paired(a[:1], b[:1]) is None and significance.paired(a, b[:5]) is None


def test_the_unpaired_test_adds_the_errors_in_quadrature():
    got = significance.unpaired(0.60, 0.03, 0.50, 0.04)
    assert got.p == pytest.approx(2 * stats.norm.sf(0.10 / 0.05))
    assert significance.unpaired(0.6, math.nan, 0.5, 0.04) is None  # one example: unknown


def test_the_loss_stderr_is_the_ratio_estimators():
    sums, counts = np.array([10.0, 12.0, 9.0, 11.0]), np.array([4.0, 4.0, 4.0, 4.0])
    means = sums / counts  # equal counts: the standard error of the batch means
    assert significance.ratio_stderr(sums, counts) == pytest.approx(
        means.std(ddof=1) / math.sqrt(4))
    assert math.isnan(significance.ratio_stderr(sums[:1], counts[:1]))


def _scored_run(root, name, lr, correct, *, fingerprint="abc", loss=2.4, loss_se=0.01,
                losses=None):
    """A run whose last in-loop evaluation scored ``correct`` (0/1 per example) on task mc."""
    run = make_run(root / name, (f"--optimizer.lr={lr}", "--evals.mc.type=multiple_choice",
                                 "--evals.mc.path=mc.jsonl"), evals=())
    values = np.asarray(correct, dtype=float)
    se = values.std(ddof=1) / math.sqrt(len(values))
    line = {"step": 30, "eval/mc/acc": float(values.mean()), "eval/mc/acc_stderr": float(se),
            "eval/mc/examples": len(values), "eval/mc/fingerprint": fingerprint,
            "eval/loss": loss, "eval/loss_stderr": loss_se, "eval/batches": 4,
            "eval/fingerprint": fingerprint}
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")
    unit_scores.save(run, "mc", 30, np.stack([values, values], 1), ["acc", "acc_norm"])
    if losses is not None:
        unit_scores.save(run, unit_scores.LOSS, 30, np.asarray(losses), ["loss_sum", "tokens"],
                         task=False)
    return str(run)


def test_a_clear_difference_names_a_winner_and_a_close_one_does_not(tmp_path):
    rng = np.random.default_rng(1)
    base = rng.integers(0, 2, 400)
    better = np.where(rng.random(400) < 0.3, 1, base)  # flips ~15% of the wrong ones to right
    close = np.where(rng.random(400) < 0.01, 1 - base, base)
    a = _scored_run(tmp_path, "a", 1e-3, base)
    b = _scored_run(tmp_path, "b", 3e-3, better)
    c = _scored_run(tmp_path, "c", 1e-2, close)
    lines = verdicts([a, b])
    assert any(x.startswith("winner on mc acc: b, better than every other run beyond noise "
                            "(the closest: p < 0.0001, paired t, n=400)") for x in lines), lines
    (line,) = [x for x in verdicts([a, c]) if "mc acc" in x]
    assert line.startswith("no winner on mc acc: ") and "within noise" in line
    assert "paired t, n=400" in line
    table = report([a, b, c], width=0)
    head, row_a, row_b, row_c = table.splitlines()[:4]
    assert "mc acc (n=400)" in head
    mc = {name: [t for t in row.split() if "±" in t][-1]
          for name, row in (("a", row_a), ("b", row_b), ("c", row_c))}
    assert mc["b"].startswith(f"{better.mean():.4f}±") and mc["b"].endswith("*")
    assert not mc["a"].endswith(("*", "~"))  # a and c are both beyond noise of b
    assert not mc["c"].endswith(("*", "~"))
    assert "*: the column's best run; ~: within noise of it" in " ".join(table.split())


def test_runs_on_other_held_out_data_are_flagged_not_judged(tmp_path):
    a = _scored_run(tmp_path, "a", 1e-3, [1, 0, 1, 1], fingerprint="one")
    b = _scored_run(tmp_path, "b", 3e-3, [0, 0, 1, 0], fingerprint="two")
    table = report([a, b], width=0)
    assert "eval loss!" in table.splitlines()[0] and "mc acc (n=4)!" in table.splitlines()[0]
    assert "the runs were scored on different data (fingerprints one, two)" in table
    assert "*" not in "".join(table.splitlines()[1:3])
    assert any(x.startswith("no verdict on eval loss: the runs were scored on different data")
               for x in verdicts([a, b]))


def test_the_loss_is_paired_on_its_eval_batches(tmp_path):
    shared = np.array([[10.0, 4.0], [12.0, 4.0], [9.0, 4.0], [11.0, 4.0]])
    lower = shared - [[0.4, 0], [0.41, 0], [0.39, 0], [0.4, 0]]
    a = _scored_run(tmp_path, "a", 1e-3, [1, 0], loss=2.625, loss_se=0.2, losses=shared)
    b = _scored_run(tmp_path, "b", 3e-3, [1, 0], loss=2.525, loss_se=0.2, losses=lower)
    (line,) = [x for x in verdicts([a, b]) if "eval loss" in x]
    # unpaired, the errors (0.2 each) would swamp a 0.1 difference; paired, it is clear
    assert line.startswith("winner on eval loss: b") and "paired t, n=4" in line


def test_the_table_wraps_within_120_columns_and_columns_can_be_chosen(tmp_path, capsys):
    a = _scored_run(tmp_path, "a-long-run-name", 1e-3, [1, 0, 1, 1])
    b = _scored_run(tmp_path, "b-long-run-name", 3e-3, [0, 0, 1, 0])
    assert main(["compare", a, b, "--width", "120"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines()[:7])) <= 120 and out.count("\nrun ") >= 1
    assert main(["compare", a, b, "--columns", "eval loss,mc acc"]) == 0
    head = capsys.readouterr().out.splitlines()[0].split("  ")
    assert [h.strip() for h in head if h.strip()] == ["run", "eval loss", "mc acc (n=4)"]
    assert main(["compare", a, b, "--columns", "nope"]) == 2
    assert "--columns 'nope': no such column" in capsys.readouterr().err


def test_a_steps_own_score_is_judged_and_its_other_held_out_values_are_not_columns(tmp_path):
    """A preference step's eval/rewards/accuracies (with its examples, stderr and fingerprint)
    is judged like a task; its eval/logps/* are values, not scores: no column, no verdict."""
    runs = []
    for name, accuracy in (("a", 0.55), ("b", 0.85)):
        run = make_run(tmp_path / name, evals=())
        line = {"step": 30, "eval/rewards/accuracies": accuracy,
                "eval/rewards/accuracies_stderr": math.sqrt(accuracy * (1 - accuracy) / 199),
                "eval/rewards/examples": 200, "eval/rewards/fingerprint": "abc",
                "eval/rewards/margins": 0.1, "eval/logps/chosen": -60.0,
                "eval/logps/rejected": -61.0}
        with (run / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")
        runs.append(run)
    head = report(runs, width=0).splitlines()[0]
    assert "rewards accuracies (n=200)" in head and "logps" not in head
    lines = verdicts(runs)
    assert any(x.startswith("winner on rewards accuracies: b") for x in lines), lines
    assert not any("logps" in x for x in lines)


def test_a_run_short_of_its_last_step_is_noted(tmp_path):
    """The last session's total_steps says where a run ends (a budget in tokens too); without
    the marker, the recipe's training.steps."""
    done = make_run(tmp_path / "done", ("--training.steps=30",))
    cut = make_run(tmp_path / "cut", ("--training.steps=30",), losses=(3.0, 2.6))
    grown = make_run(tmp_path / "grown", ("--training.steps=30",))
    with (grown / "metrics.jsonl").open("a") as f:  # resumed with a longer budget, stopped
        f.write(json.dumps({"step": 30, "loss": 1.9, "session": {"from_step": 30,
                                                                 "total_steps": 60}}) + "\n")
    table = report([str(done), str(cut), str(grown)], width=0)
    assert "cut: not finished (logged up to step 20 of 30), so its figures are not its final" \
        in table
    assert "grown: not finished (logged up to step 30 of 60)" in table
    assert "done: not finished" not in table

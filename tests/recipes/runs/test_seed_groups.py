"""Runs that differ only in training.seed are judged as points over their seeds: the mean and
its standard error across seeds, a t-test paired by seed (or Welch's), in `kiln compare`'s
second table and the sweep's verdict."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kiln.recipes.commands.compare import report, verdicts
from kiln.recipes.runs import significance
from tests.recipes.run_folders import make_run

stats = pytest.importorskip("scipy.stats")


def _run(root, lr, seed, loss, *, fingerprint="same", loss_se=0.2) -> str:
    """A run whose last evaluation gave ``loss`` with a wide per-run error (``loss_se``)."""
    run = make_run(root / f"lr={lr},seed={seed}",
                   (f"--optimizer.lr={lr}", f"--training.seed={seed}"), evals=())
    line = {"step": 30, "eval/loss": loss, "eval/loss_stderr": loss_se, "eval/batches": 4,
            "eval/fingerprint": fingerprint}
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(line) + "\n")
    return str(run)


def test_a_setting_better_under_every_seed_wins_paired_by_seed(tmp_path):
    worse = [3.10, 3.30, 3.02]  # seeds move the loss far more than the change does
    better = [3.05, 3.24, 2.98]
    runs = [_run(tmp_path, 1e-3, s, v) for s, v in enumerate(worse)]
    runs += [_run(tmp_path, 3e-3, s, v) for s, v in enumerate(better)]
    (line,) = verdicts(runs)  # three seeds a point: no caution
    assert "degree of freedom" not in report(runs, width=0)
    p = stats.ttest_rel(worse, better).pvalue
    assert line == (f"across seeds, winner on eval loss: lr=0.003, better than every other point "
                    f"beyond noise (the closest: {significance.p_text(p)}, paired t by seed, "
                    "n=3)")
    table = report(runs, width=0)
    points = table.split("Across seeds")[1].splitlines()
    row = {r.split()[0]: r.split() for r in points[2:4]}
    se = np.std(better, ddof=1) / math.sqrt(3)
    assert row["lr=0.003"] == ["lr=0.003", "0,1,2", f"{np.mean(better):.4f}±{se:.4f}*"]
    assert row["lr=0.001"][2].startswith(f"{np.mean(worse):.4f}±")
    assert not row["lr=0.001"][2].endswith(("*", "~"))  # beyond noise
    assert "a t-test over the seeds, paired by seed" in " ".join(table.split())
    rows = json.loads(report(runs, as_json=True))
    point = rows[4]["point"]  # lr=3e-3, seed 1
    assert point["label"] == "lr=0.003" and point["seeds"] == [0, 1, 2]
    assert point["eval_loss"] == pytest.approx(np.mean(better))
    assert point["stderr"]["eval_loss"] == pytest.approx(se)
    assert point["judged"] == {"eval_loss": {"mark": "*"}}
    other = rows[0]["point"]["judged"]["eval_loss"]
    assert other["mark"] == "" and other["test"] == "paired t by seed, n=3"


def test_points_of_other_seeds_take_welchs_test_and_spread_keeps_them_within_noise(tmp_path):
    a = [3.10, 3.30]
    b = [3.05, 3.40]
    runs = [_run(tmp_path, 1e-3, s, v) for s, v in zip((0, 1), a, strict=True)]
    runs += [_run(tmp_path, 3e-3, s, v) for s, v in zip((2, 3), b, strict=True)]
    (line,) = verdicts(runs)
    p = stats.ttest_ind(a, b, equal_var=False).pvalue
    assert line.startswith("across seeds, no winner on eval loss: lr=0.001 has the best value")
    assert f"lr=0.003 ({significance.p_text(p)}, Welch t over seeds, n=2/2)" in line
    # two seeds a point: a t-test with one degree of freedom, said under the table (which the
    # sweep prints above its verdict)
    table = report(runs, width=80)
    caution = " ".join(table.split("note: ")[-1].split())
    assert caution.startswith("a point with 2 seeds gives its t-test 1 degree of freedom")
    assert "kiln sweep --seeds 3" in caution
    assert max(len(line) for line in table.splitlines()) <= 80  # wrapped like the legend


def test_runs_scored_on_other_data_get_no_verdict_across_seeds_either(tmp_path):
    runs = [_run(tmp_path, 1e-3, s, 3.0 + s / 10, fingerprint=f"f{s}") for s in (0, 1)]
    runs += [_run(tmp_path, 3e-3, s, 2.9 + s / 10) for s in (0, 1)]
    (line,) = verdicts(runs)
    assert line.startswith("across seeds, no verdict on eval loss: the runs were scored on "
                           "different data")


def test_without_a_repeat_of_every_setting_runs_are_judged_one_by_one(tmp_path):
    runs = [_run(tmp_path, 1e-3, s, 3.0) for s in (0, 1)] + [_run(tmp_path, 3e-3, 0, 2.0)]
    (line,) = verdicts(runs)
    assert line.startswith("winner on eval loss: lr=0.003,seed=0, better than every other run")
    assert "Across seeds" not in report(runs, width=0)


def test_welch_is_scipys_and_equal_constant_sets_are_no_evidence():
    a, b = np.array([1.0, 1.2, 0.9]), np.array([1.4, 1.5])
    got = significance.welch(a, b)
    assert got.p == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    assert got.how == "Welch t over seeds, n=3/2"
    assert significance.welch(np.ones(2), np.ones(3)).p == 1.0
    assert significance.welch(np.ones(2), np.zeros(2)).p == 0.0
    assert significance.welch(a[:1], b) is None
    assert significance.paired(a, a + 0.1 * np.array([1, 2, 3]), unit="seeds").how == \
        "paired t by seed, n=3"


def _rl_run(root, eps, seed, rewards) -> str:
    """An RL run (no held-out loss) whose logged rewards are ``rewards``."""
    run = make_run(root / f"eps={eps},seed={seed}", (f"--training.seed={seed}",
                                                     f"--optimizer.lr={eps}"),
                   losses=(0.0,) * len(rewards), evals=())
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for line, r in zip(lines, rewards, strict=True):
        line["reward"] = r
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(run)


def test_an_rl_runs_reward_is_judged_across_seeds_not_run_by_run(tmp_path):
    """Each seed's reward (its last 10 logged values' mean) is one independent value: the points
    get a t-test over seeds; a single run's reward carries no error bar and no mark."""
    low = [0.20, 0.35, 0.26]
    high = [0.30, 0.44, 0.37]
    runs = [_rl_run(tmp_path, 1e-3, s, [0.0] * 5 + [v] * 10) for s, v in enumerate(low)]
    runs += [_rl_run(tmp_path, 3e-3, s, [0.0] * 5 + [v] * 10) for s, v in enumerate(high)]
    (line,) = verdicts(runs)
    p = stats.ttest_rel(low, high).pvalue
    assert line == (f"across seeds, winner on reward (last 10): lr=0.003, better than every "
                    f"other point beyond noise (the closest: {significance.p_text(p)}, paired t "
                    "by seed, n=3)")
    table = report(runs, width=0)
    per_run, points = table.split("Across seeds")
    assert "±" not in per_run.splitlines()[1] and "*" not in per_run  # runs: plain values
    row = {r.split()[0]: r.split() for r in points.splitlines()[2:4]}
    se = np.std(high, ddof=1) / math.sqrt(3)
    assert row["lr=0.003"][2] == f"{np.mean(high):.4f}±{se:.4f}*"
    point = json.loads(report(runs, as_json=True))[3]["point"]
    assert point["reward"] == pytest.approx(np.mean(high))
    assert point["stderr"]["reward"] == pytest.approx(se)
    assert point["judged"] == {"reward": {"mark": "*"}}

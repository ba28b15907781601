"""`kiln plot`: a PNG with every run's curves and a legend naming what differs, the expert-load
heatmap of MoE runs, smoothing, and the messages for unknown metrics."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kiln.recipes.cli import main
from kiln.recipes.hooks.plot import PlotConfig, PlotHook
from kiln.recipes.runs.plots import legend_labels, plot_series, resolve_metrics, smooth
from kiln.recipes.runs.read import open_run, open_runs
from tests.recipes.run_folders import make_run

pytest.importorskip("matplotlib")


def _png(path) -> tuple[int, int]:
    """(width, height) from the PNG header; fails on anything that is not a whole PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data.endswith(b"IEND\xaeB`\x82")
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_legend_names_what_differs(tmp_path):
    a = make_run(tmp_path / "a", ("--optimizer.lr=1e-3",))
    b = make_run(tmp_path / "b", ("--optimizer.lr=3e-3",))
    c = make_run(tmp_path / "c", ("--optimizer.lr=3e-3",))
    assert legend_labels(open_runs([str(a), str(b)])) == ["lr=0.001", "lr=0.003"]
    assert legend_labels(open_runs([str(b), str(c)])) == ["b", "c"]  # nothing differs
    assert legend_labels(open_runs([str(a), str(b), str(c)])) == [
        "lr=0.001", "b: lr=0.003", "c: lr=0.003"]


def test_metric_names_select_sub_keys_and_unknown_ones_are_refused(tmp_path):
    runs = [open_run(make_run(tmp_path / "a"))]
    assert resolve_metrics(runs, None) == ["loss", "eval/loss", "lr/main", "grad_norm"]
    assert resolve_metrics(runs, ["lr"]) == ["lr/main"]
    with pytest.raises(Exception, match="no run logged 'eval/bleu'"):
        resolve_metrics(runs, ["loss", "eval/bleu"])


def test_by_default_an_rl_run_draws_its_reward_and_a_tuned_run_its_task_scores(tmp_path):
    """reward and each in-loop task's headline score are default panels where logged; a curve
    that happens to equal another metric's (a reward and a loss both 0, an eval loss and a task
    score both 0.25) is still drawn: only a key repeating another of the same name
    (lr/main/no_decay beside lr/main) is left out."""
    run = make_run(tmp_path / "a", ("--evals.em.type=exact_match", "--evals.em.path=x.jsonl",
                                    "--eval.interval=0", "--eval.at_end=false"),
                   losses=(0.0, 0.0), evals=(0.25,), extra={"reward": 0.0})
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 20, "eval/em/exact_match": 0.25,
                            "eval/em/exact_match_stderr": 0.1, "eval/em/examples": 8}) + "\n")
    assert resolve_metrics([open_run(run)], None) == [
        "loss", "eval/loss", "lr/main", "grad_norm", "reward", "eval/em/exact_match"]


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([1.0, 2.0], 1) == [1.0, 2.0]


@pytest.mark.slow
def test_plot_writes_a_png_with_a_heatmap_panel_for_moe_runs(tmp_path, capsys):
    a = make_run(tmp_path / "a", ("--optimizer.lr=1e-3",))
    b = make_run(tmp_path / "b", ("--optimizer.lr=3e-3",))
    out = tmp_path / "out" / "curves.png"
    assert main(["plot", str(a), str(b), "--out", str(out), "--x", "tokens",
                 "--smooth", "2"]) == 0
    assert "wrote" in capsys.readouterr().out
    _, plain_height = _png(out)
    loads = {10: {"1": [0.5, 0.5, 0.0, 0.0]}, 20: {"1": [0.25, 0.25, 0.25, 0.25]}}
    moe = make_run(tmp_path / "moe", experts={s: {**v, "2": v["1"]} for s, v in loads.items()})
    assert main(["plot", str(moe), "--out", str(out)]) == 0
    _, with_heatmap = _png(out)
    assert with_heatmap > plain_height  # one more row of panels: the heatmap
    assert main(["plot", str(moe), "--out", str(out), "--no-experts"]) == 0
    assert _png(out)[1] == plain_height
    assert not list(out.parent.glob(".*tmp*"))  # written through a temporary file


def test_plot_bad_input(tmp_path, capsys):
    run = make_run(tmp_path / "a")
    assert main(["plot", str(run), "--metrics", "bleu", "--out", str(tmp_path / "x.png")]) == 2
    assert "no run logged 'bleu'" in capsys.readouterr().err
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "not a run folder" in capsys.readouterr().err
    assert main(["plot", str(run), "--out", str(tmp_path / "x.pdf")]) == 2
    assert "write a .png file" in capsys.readouterr().err


def test_time_axis_leaves_out_lines_whose_interval_is_not_a_number(tmp_path, capsys):
    import json

    run = make_run(tmp_path / "a", losses=(3.0, 2.5, 2.0, 1.5))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    damaged = [json.loads(line) for line in lines]
    damaged[1]["interval_s"], damaged[2]["interval_s"] = "2.0", None
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in damaged))
    assert main(["plot", str(run), "--out", str(tmp_path / "c.png"), "--x", "time"]) == 0
    err = capsys.readouterr().err  # one warning for all the curves
    assert err.count("warning") == 1 and "2 lines whose interval_s is not a number" in err
    from kiln.recipes.runs.read import series

    xs, ys = series(open_run(run), "loss", "time")
    assert ys == [3.0, 2.5, 2.0, 1.5] and xs[0] == 2.0 and xs[-1] == 4.0  # two intervals known
def test_a_panel_equal_to_another_is_not_drawn_twice(tmp_path):
    run = make_run(tmp_path / "a")
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for x in lines:
        if "lr/main" in x:
            x["lr/main/no_decay"] = x["lr/main"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    b = make_run(tmp_path / "b")
    assert resolve_metrics([open_run(run)], ["lr"]) == ["lr/main"]
    assert resolve_metrics([open_run(run)], None) == ["loss", "eval/loss", "lr/main", "grad_norm"]
    # another run without no_decay: the two panels differ, both are drawn
    assert resolve_metrics([open_run(run), open_run(b)], ["lr"]) == ["lr/main", "lr/main/no_decay"]


def test_a_single_point_gets_a_marker_and_its_value():
    plt = pytest.importorskip("matplotlib.pyplot")
    fig, ax = plt.subplots()
    plot_series(ax, [300.0], [2.4567], "lr=0.001")
    plot_series(ax, [1.0, 2.0], [3.0, 2.0], "lr=0.003")
    lone, line = ax.lines
    assert lone.get_marker() == "o" and lone.get_markersize() >= 6
    assert [t.get_text() for t in ax.texts] == ["2.457"]
    assert line.get_marker() == "."
    plt.close(fig)


def test_an_unknown_metric_gets_a_did_you_mean_and_a_short_wrapped_list(tmp_path):
    extra = {f"diag/act/{i}/rms": 1.0 for i in range(40)}
    runs = [open_run(make_run(tmp_path / "a", extra=extra))]
    with pytest.raises(Exception) as info:
        resolve_metrics(runs, ["eval/los"])
    text = str(info.value)
    assert "no run logged 'eval/los' (did you mean 'eval/loss'?)" in text
    assert "diag/... (40 keys)" in text and "diag/act/3/rms" not in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_the_plot_at_the_end_is_drawn_after_the_final_evaluation(monkeypatch):
    """The last step is a multiple of the interval: its plot waits for on_train_end, which
    runs after the evaluation hooks' (the standard hooks' order)."""
    from kiln.recipes.config.files import load_recipe
    from kiln.recipes.training.hook_set import by_priority, standard_hooks
    from tests.conftest import CONFIGS

    drawn = []
    monkeypatch.setattr(PlotHook, "draw", lambda self, trainer: drawn.append(
        trainer.progress.step))
    hook = PlotHook(PlotConfig(interval=10))
    trainer = SimpleNamespace(progress=SimpleNamespace(step=10), total_steps=20)
    hook.on_step_end(trainer, None)
    trainer.progress.step = 20
    hook.on_step_end(trainer, None)
    assert drawn == [10]
    hook.on_train_end(trainer)
    assert drawn == [10, 20]
    recipe = load_recipe(CONFIGS / "debug_evals.toml", ["--run.plot_interval=10"])
    kinds = [type(h).__name__ for h in by_priority(standard_hooks(recipe))]
    assert kinds.index("PlotHook") > max(kinds.index("EvalHook"),
                                         kinds.index("DownstreamEvalHook"))


def _seeded(tmp_path, lr, seed, losses):
    return make_run(tmp_path / f"lr={lr},seed={seed}", (f"--optimizer.lr={lr}",
                                                         f"--training.seed={seed}",
                                                         "--training.steps=30"), losses=losses)


def test_runs_that_differ_only_in_their_seed_are_one_mean_line_in_a_band(tmp_path,
                                                                         monkeypatch):
    from kiln.recipes.runs import plots

    runs = [_seeded(tmp_path, 1e-3, 0, (3.0, 2.0, 1.0)), _seeded(tmp_path, 1e-3, 1, (4.0, 2.5)),
            _seeded(tmp_path, 3e-3, 0, (3.0, 2.0, 1.5)),
            _seeded(tmp_path, 3e-3, 1, (3.2, 2.2, 1.7))]
    opened = open_runs([str(r) for r in runs])
    xs, mean, low, high = plots.point_series(opened, [0, 1], "loss", "step")
    assert xs == [10, 20] and mean == [3.5, 2.25] and low == [3.0, 2.0] and high == [4.0, 2.5]
    tokens = plots.point_series(opened, [0, 1], "loss", "tokens")[0]
    assert tokens == [2048 * 10, 2048 * 20]  # the steps both seeds logged, on the tokens axis
    drawn = []
    monkeypatch.setattr(plots, "plot_band", lambda ax, xs, mean, low, high, label:
                        drawn.append((label, xs)) or ax.plot(xs, mean, label=label))
    monkeypatch.setattr(plots, "save", lambda fig, out: out)
    plots.draw(opened, tmp_path / "p.png", metrics=["loss"])
    assert drawn == [("lr=0.001 (2 seeds)", [10, 20]), ("lr=0.003 (2 seeds)", [10, 20, 30])]
    drawn.clear()
    plots.draw(opened, tmp_path / "p.png", metrics=["loss"], each_seed=True)
    assert drawn == []  # a line per run instead


def test_a_band_is_shaded_in_its_lines_colour_and_a_lone_point_gets_an_error_bar():
    plt = pytest.importorskip("matplotlib.pyplot")
    from kiln.recipes.runs.plots import plot_band

    fig, ax = plt.subplots()
    plot_band(ax, [1.0, 2.0], [3.0, 2.0], [2.5, 1.5], [3.5, 2.5], "lr=0.001 (2 seeds)")
    (line,) = ax.lines
    (band,) = ax.collections
    assert line.get_label() == "lr=0.001 (2 seeds)"
    assert tuple(band.get_facecolor()[0][:3]) == pytest.approx(
        plt.matplotlib.colors.to_rgb(line.get_color()))
    plot_band(ax, [5.0], [2.0], [1.5], [2.75], "one evaluation")
    bars = ax.containers[-1]
    assert bars.get_label() == "one evaluation" and [t.get_text() for t in ax.texts] == ["2"]
    plt.close(fig)

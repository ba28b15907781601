"""`kiln plot`: a PNG with every run's curves and a legend naming what differs, the expert-load
heatmap of MoE runs, smoothing, and the messages for unknown metrics."""

from __future__ import annotations

import pytest

from kiln.recipes.cli import main
from kiln.recipes.runs.plots import legend_labels, resolve_metrics, smooth
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
    with pytest.raises(Exception, match="no run logged 'eval/bleu'; the runs logged: eval/bpb"):
        resolve_metrics(runs, ["loss", "eval/bleu"])


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert smooth([1.0, 2.0], 1) == [1.0, 2.0]


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

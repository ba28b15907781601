"""`kiln fit`: one ladder or two from CSVs, the table, --json, the plot, the crossing and the
difference at the target, and one line for input no fit should come from."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.recipes.cli import main
from tests.recipes.scaling.ladders import BESIROGLU, HOFFMANN, ladder, write_csv


@pytest.fixture(scope="module")
def csvs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ladders")
    paths = []
    for name, law in (("hoffmann", HOFFMANN), ("besiroglu", BESIROGLU)):
        write_csv(folder / f"{name}.csv", *ladder(law, sigma=0.005, seed=1))
        paths.append(str(folder / f"{name}.csv"))
    return paths


def test_json_has_every_parameter_with_its_interval(csvs, capsys):
    assert main(["fit", csvs[0], "--json", "--bootstrap=200",
                 "--target-params=1e10", "--target-tokens=2e11"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["form"] == "chinchilla" and out["bootstrap"] == 200 and out["level"] == 0.95
    (lad,) = out["ladders"]
    assert set(lad["params"]) == {"E", "A", "B", "alpha", "beta"}
    for name in ("E", "A", "B", "alpha", "beta"):
        p = lad["params"][name]
        lo, hi = p["interval"]
        assert lo <= p["value"] <= hi
    truth = HOFFMANN[0] + HOFFMANN[1] / 1e10**HOFFMANN[3] + HOFFMANN[2] / 2e11**HOFFMANN[4]
    assert lad["prediction"]["loss"] == pytest.approx(truth, rel=0.02)


def test_two_ladders_table_crossing_difference_and_plot(csvs, tmp_path, capsys):
    png = tmp_path / "fit.png"
    assert main(["fit", *csvs, "--bootstrap=100", "--target-flops=1e23",
                 f"--plot={png}"]) == 0
    out = capsys.readouterr().out
    assert "form chinchilla: L = E + A / N^alpha + B / D^beta; 100 bootstrap" in out
    assert "predicted loss at C=1e+23" in out and "the curves cross at" in out
    assert "difference (" in out and png.stat().st_size > 10_000
    # The reported crossing is where the two compute-optimal curves meet.
    assert main(["fit", *csvs, "--bootstrap=0", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["crossings"] and "difference" not in out
    assert out["ladders"][0]["params"]["alpha"]["interval"] is None


def test_a_fixed_ratio_ladder_is_fitted_in_n_and_refused_in_n_d(tmp_path, capsys):
    n = np.logspace(7, 9, 6)
    loss = 1.7 + 400.0 / n**0.34 + 410.0 / (20 * n) ** 0.28
    write_csv(tmp_path / "ratio.csv", n, 20 * n, loss)
    assert main(["fit", str(tmp_path / "ratio.csv"), "--bootstrap=50",
                 "--target-params=1e10"]) == 0
    assert capsys.readouterr().out.startswith("form params: L = E + A / N^alpha")
    assert main(["fit", str(tmp_path / "ratio.csv"), "--form=chinchilla"]) == 2
    assert "tokens grow in proportion to parameters" in capsys.readouterr().err
    # the compute form on the CSV's own FLOPs column, with its plot
    write_csv(tmp_path / "flops.csv", n, 20 * n, loss, flops=6.5 * n * 20 * n)
    png = tmp_path / "compute.png"
    assert main(["fit", str(tmp_path / "flops.csv"), "--form=compute", "--bootstrap=50",
                 "--target-flops=1e21", f"--plot={png}", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["form"] == "compute" and set(out["ladders"][0]["params"]) == {"E", "A", "alpha"}
    lo, hi = out["ladders"][0]["prediction"]["interval"]
    assert lo <= out["ladders"][0]["prediction"]["loss"] <= hi and png.stat().st_size > 10_000


@pytest.mark.parametrize("args, message", [
    (["--form=params", "--target-flops=1e20"], "params form predicts from --target-params"),
    (["--target-params=1e9"], "--target-params with --target-tokens"),
    (["--level=1.5"], "between 0 and 1"),
])
def test_bad_targets_get_one_line(csvs, capsys, args, message):
    assert main(["fit", csvs[0], "--bootstrap=0", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_degenerate_csv_gets_one_line(tmp_path, capsys):
    write_csv(tmp_path / "few.csv", np.array([1e7, 1e8]), np.array([1e8, 1e9]),
              np.array([3.0, 2.5]))
    assert main(["fit", str(tmp_path / "few.csv")]) == 2
    err = capsys.readouterr().err
    assert "few.csv: 2 points for the params form's 3 parameters" in err

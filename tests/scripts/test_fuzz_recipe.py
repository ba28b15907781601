"""scripts/fuzz_recipe.py: every mutation of a key runs validate's checks; kiln's one-line errors
pass, a raw exception is reported once per place it came from, and the exit status says so."""

from __future__ import annotations

import json
import runpy
from pathlib import Path

from tests.conftest import CONFIGS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fuzz_recipe.py"


def _main():
    return runpy.run_path(str(SCRIPT))["main"]


def test_kiln_errors_pass_and_accepted_mutations_are_written(tmp_path, capsys):
    accepted = tmp_path / "accepted.json"
    status = _main()([str(CONFIGS / "debug.toml"), "--keys", "optimizer.betas,optimizer.eps",
                      "--accepted", str(accepted)])
    out = capsys.readouterr().out
    assert status == 0 and "RAW" not in out
    # betas: the list value only has the wrong length; eps: 1e30, 0.5, 2, 7 are > 0
    assert out.strip().endswith("20 recipes tried, 4 accepted, 0 raw exception(s)"), out
    assert json.loads(accepted.read_text()) == [[f"--optimizer.eps={v}"]
                                                for v in ("1e30", "0.5", "2", "7")]


def test_a_raw_exception_is_reported_once_per_place(capsys):
    fuzz = runpy.run_path(str(SCRIPT))

    def describe(recipe, world_size, data):  # an unchecked value deep in a component
        if recipe.optimizer.eps > 1:
            raise ValueError("eps too large")
        return ""

    fuzz["main"].__globals__["describe"] = describe
    status = fuzz["main"]([str(CONFIGS / "debug.toml"), "--keys", "optimizer.eps"])
    out = capsys.readouterr().out
    assert status == 1
    raw = [line for line in out.splitlines() if line.startswith("RAW")]
    assert len(raw) == 1 and raw[0].startswith("RAW --optimizer.eps=1e30: ValueError: eps too "
                                               "large (tests/scripts/test_fuzz_recipe.py:")

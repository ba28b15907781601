"""scripts/shared_prompt.py (docs/benchmarks.md's shared-prompt table) runs and measures: the
shared cache holds the prompts once (P prompt rows plus every row's own tokens, against every
row's copy of its prompt) and both give the same logits."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "shared_prompt.py"


def test_the_report_measures_both_caches(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [
        str(SCRIPT), "--prompts", "2", "--groups", "3", "--lengths", "8", "--steps", "4",
        "--repeats", "1", "--threads", "0",
        *(f"--override=--model.{o}" for o in ("n_layers=1", "dim=32", "attention.n_heads=2",
                                              "attention.n_kv_heads=2", "ffn.hidden_dim=32"))])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    row = re.search(r"^\| 8 \| 3 \| (.*) \|$", out, flags=re.M).group(1).split(" | ")
    copied_kib, shared_kib, diff = float(row[3]), float(row[4]), float(row[5])
    per_token = 2 * 2 * 16 * 4 / 1024  # one layer: keys and values, 2 heads of 16, fp32
    assert copied_kib == 6 * (8 + 4) * per_token  # every row: its prompt and own tokens
    assert shared_kib == (2 * 8 + 6 * 4) * per_token  # the prompts once, each row's own tokens
    assert diff < 1e-5

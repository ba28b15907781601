"""scripts/mla_cache.py (docs/models.md's latent-cache table) runs and measures: the latent
cache's bytes per token are kv_rank + rope_head_dim numbers per layer, the expanded one's
n_heads * (qk + v), and both give the same logits."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "mla_cache.py"


def test_the_cache_report_measures_both_caches(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [
        str(SCRIPT), "--dim", "32", "--layers", "2", "--heads", "2", "--kv-rank", "8",
        "--q-rank", "0", "--nope", "8", "--tokens", "24", "--repeats", "1", "--threads", "0"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| (latent|expanded) \| ([\d,]+) \|", out, flags=re.M))
    assert int(rows["latent"].replace(",", "")) == 2 * (8 + 16) * 4  # 2 layers, fp32
    assert int(rows["expanded"].replace(",", "")) == 2 * 2 * (8 + 16 + 8) * 4
    diff = float(re.search(r"largest logit difference (\S+)", out).group(1))
    assert diff < 1e-4

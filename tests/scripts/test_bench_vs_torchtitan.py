"""scripts/bench_vs_torchtitan.py: the side-by-side ratio script (the peer needs torchtitan 0.2.x
in its own environment, so the full comparison runs only where it is installed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "bench_vs_torchtitan.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_vs_torchtitan", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_render_names_the_cpu_and_gives_the_ratio():
    result = {"cpu": "Some CPU", "threads": 2, "torch": "2.13.0", "torchtitan": "0.2.2",
              "rounds": 3, "steps": 20, "rows": {"fp32": {
                  "kiln_tokens_per_second": 3100.0, "torchtitan_tokens_per_second": 3000.0,
                  "ratio": 1.0333, "kiln_time_to_first_step_s": 3.0,
                  "torchtitan_time_to_first_step_s": 9.0, "params": [6163712, 6163712]}}}
    text = _module().render(result)
    assert text.startswith("CPU: Some CPU, 2 threads") and "1.03x" in text and "3,100" in text


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is not None,
                    reason="torchtitan is installed here")
def test_the_peer_says_what_to_install():
    out = subprocess.run([sys.executable, str(SCRIPT), "--peer", "--steps", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "torchtitan 0.2.x" in out.stderr


@pytest.mark.slow
def test_one_small_round_side_by_side():
    pytest.importorskip("torchtitan")
    out = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--steps", "1",
                          "--warmup", "1", "--threads", "1", "--dtype", "fp32", "--json"],
                         capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    import json

    row = json.loads(out.stdout)["rows"]["fp32"]
    assert row["params"] == [6163712, 6163712] and row["ratio"] > 0

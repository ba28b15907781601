"""The GPU check's CPU dry run: scripts/gpu_wheels.sh, then scripts/gpu_check.sh --cpu installs
the wheels and kiln into a private folder (--no-index) and runs the check's rows at tiny size,
so the one-call GPU command cannot rot while no GPU is at hand. Needs the package registry
(pip download) and a few minutes: slow."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_cpu_dry_run_installs_offline_and_writes_the_table(tmp_path):
    wheels, out = tmp_path / "whl", tmp_path / "out"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    got = subprocess.run(["scripts/gpu_wheels.sh", "--python-version", version, "--dest",
                          str(wheels)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    assert sum(f.stat().st_size for f in wheels.rglob("*.whl")) < 64 * 2**20
    env = {**os.environ, "WHEELS": str(wheels), "SITE": str(tmp_path / "site"), "OUT": str(out),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    # eager rows of both shapes and the peer; compile / fp8 rows differ only in overrides
    # (tests/parallelisms covers those), and would add minutes of CPU compilation here
    run = subprocess.run(["scripts/gpu_check.sh", "--cpu", "--only", "eager"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    runtime = [line for line in (REPO / "scripts" / "gpu_wheels.txt").read_text().splitlines()
               if line.split("#")[0].strip() and not line.startswith("build/")]
    assert f"gpu_check: installed {len(runtime)} wheels + kiln" in run.stdout
    result = json.loads((out / "gpu_check.json").read_text())
    rows = result["rows"]
    assert [(r["shape"], r["setup"]) for r in rows] == [("dense ~1B", "bf16 eager"),
                                                        ("Nova ~1.2B", "bf16 eager")]
    assert all(r["kiln"]["tokens_per_second"] > 0 for r in rows)
    assert rows[0]["peer"]["tokens_per_second"] > 0 and "peer" not in rows[1]
    assert rows[0]["kiln"]["params"] == rows[0]["peer"]["params"]  # the same model
    table = (out / "gpu_check.md").read_text()
    assert "| dense ~1B | bf16 eager |" in table and "kiln / peer" in table

"""Downstream multiple-choice scoring: kiln's evaluation against lm-evaluation-harness's ``hf``
model on the same weights, through ``scripts/bench_eval.py`` (which times both sides in one
process, alternating). That script comes with kiln's downstream evaluation (issue 22); until it
is in this checkout the row says it is not available."""

from __future__ import annotations

import json
import subprocess
import sys

from bench_rows.common import REPO, Unavailable

SCRIPT = REPO / "scripts" / "bench_eval.py"


def both(p: dict) -> dict:
    """{"kiln": {...}, "peer": {...}} examples/s, best of ``rounds`` (one process)."""
    if not SCRIPT.exists():
        raise Unavailable("kiln's downstream evaluation (issue 22, scripts/bench_eval.py) is not "
                          "in this checkout yet")
    cmd = [sys.executable, str(SCRIPT), "--json", "--rounds", str(p["rounds"]), "--threads",
           str(p["threads"]), "--examples", str(p["examples"])]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    eps = r["examples_per_second"]
    from importlib import metadata

    return {"kiln": {"examples_per_second": eps["kiln"]},
            "peer": {"examples_per_second": eps["hf_loglikelihood"],
                     "version": f"lm-eval {metadata.version('lm_eval')} hf"}}

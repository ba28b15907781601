"""Downstream multiple-choice scoring: kiln's in-loop scorer against lm-evaluation-harness's
``hf`` model (its ``loglikelihood`` call) on the same weights and task, through
``scripts/bench_eval.py``, which times both sides in one process (kiln's interpreter, where
lm-eval, accelerate and transformers come with the ``dev`` extra) and reports the best of its
rounds: the row's ratio is of those bests, not a median of per-round ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib.util import find_spec

from bench_rows.common import REPO, Unavailable

SCRIPT = REPO / "scripts" / "bench_eval.py"


def both(p: dict) -> dict:
    """{"kiln": {...}, "peer": {...}} examples/s, best of ``rounds`` (one process)."""
    if not SCRIPT.exists():
        raise Unavailable("kiln's downstream evaluation (issue 22, scripts/bench_eval.py) is not "
                          "in this checkout yet")
    missing = [m for m in ("lm_eval", "accelerate", "transformers") if find_spec(m) is None]
    if missing:
        raise Unavailable(f"{', '.join(missing)} not importable in {sys.executable} (the dev "
                          "extra: pip install -e '.[dev]')")
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
                     "version": f"lm-eval {metadata.version('lm_eval')}"}}

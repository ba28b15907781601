"""scripts/bench_peers.py: the side-by-side table. The unit tests check the bookkeeping (row
selection, ratios, the Markdown); the slow ones run one tiny round of every group whose peer is
installed (``KILN_PEER_PYTHON`` names the peer environment; torchtitan lives only there), so the
script keeps working. Nothing here times anything."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from argparse import Namespace

import pytest

from tests import forked
from tests.conftest import REPO

SCRIPT = REPO / "scripts" / "bench_peers.py"
PEER_PYTHON = os.environ.get("KILN_PEER_PYTHON", sys.executable)


def _module():
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_peers"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _args(**kw) -> Namespace:
    base = {"quick": True, "steps": 20, "warmup": 3, "threads": 2, "work": REPO / "runs",
            "new_tokens": 256, "rounds": 3, "command": "python scripts/bench_peers.py"}
    return Namespace(**{**base, **kw})


def test_only_takes_names_prefixes_and_the_first_step_alias():
    bp = _module()
    every = bp.groups(_args())
    assert [g.name for g in bp.select(every, ["train"])] == [
        "train-fp32", "train-bf16", "train-fp32-compile", "train-bf16-compile"]
    assert [g.name for g in bp.select(every, ["first-step", "checkpoint"])] == [
        "train-fp32", "checkpoint"]
    assert bp.select(every, []) == every
    with pytest.raises(SystemExit, match="--only trian: unknown; choose from train-fp32"):
        bp.select(every, ["trian"])


def test_speedup_is_the_median_per_round_ratio_and_inverted_for_times():
    bp = _module()
    group = bp.Group("overhead", "overhead", "plain loop",
                     [bp.Row("step", "step_ms", "ms", higher_is_better=False, goal=">= 0.95x")],
                     third_party=False)
    results = {"overhead": {"kiln": [{"step_ms": 10.0}, {"step_ms": 12.0}, {"step_ms": 30.0}],
                            "peer": [{"step_ms": 9.0}, {"step_ms": 12.0}, {"step_ms": 15.0}],
                            "problem": ""}}
    row = bp.summarise([group], results, _args())["rows"][0]
    assert row["kiln"] == 12.0 and row["peer_value"] == 12.0
    assert row["speedup"] == pytest.approx(0.9)  # ratios 0.9, 1.0, 0.5
    assert row["notes"] == ""
    group.params["threads"] = 1  # a row with its own count (nanoGPT's) says so
    assert bp.summarise([group], results, _args())["rows"][0]["notes"] == "1 thread per side"


def test_the_table_is_markdown_with_date_cpu_command_and_every_row():
    bp = _module()
    summary = {"date": "2026-12-02", "cpu": "Some CPU", "cores": 2, "threads": 2,
               "torch": "2.13.0", "rounds": 3, "command": "python scripts/bench_peers.py",
               "rows": [
                   {"label": "dense training step, fp32 eager", "unit": "tok/s", "goal": ">= 1.3x",
                    "peer": "torchtitan, torchtitan 0.2.2", "kiln": 3101.0, "peer_value": 3000.0,
                    "speedup": 1.0333, "notes": ""},
                   {"label": "downstream multiple choice", "unit": "examples/s", "goal": "",
                    "peer": "lm-eval hf", "problem": "not in this checkout yet"}],
               "thread_env": {"OMP_WAIT_POLICY": "PASSIVE"}}
    text = bp.render(summary)
    assert "2026-12-02" in text and "`Some CPU` (2 cores)" in text
    assert "Threading environment: OMP_WAIT_POLICY=PASSIVE." in text
    assert "library defaults (none of OMP_WAIT_POLICY" in bp.render({**summary, "thread_env": {}})
    assert "Command: `python scripts/bench_peers.py`" in text
    assert "| dense training step, fp32 eager | 3,101 tok/s | torchtitan, torchtitan 0.2.2 | " \
           "3,000 tok/s | 1.03x | >= 1.3x |" in text
    assert "| downstream multiple choice | n/a | lm-eval hf | n/a | n/a | - | not in this " \
           "checkout yet |" in text


@pytest.mark.slow
def test_a_side_whose_peer_is_missing_reports_it_instead_of_failing(tmp_path):
    if _peer_has("torchtitan", sys.executable):
        pytest.skip("torchtitan is installed in this interpreter")
    out = forked.run([sys.executable, str(SCRIPT), "--side", "moe", "--who", "peer",
                      "--params", json.dumps({"threads": 1})], REPO, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "torchtitan 0.2.x and triton are not importable" in json.loads(
        out.stdout.splitlines()[-1])["unavailable"]


@functools.cache  # a fresh interpreter per question; the slow tests ask each several times
def _peer_has(module: str, python: str = PEER_PYTHON) -> bool:
    return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


NEEDS = {"train": "torchtitan", "moe": "torchtitan", "generate": "transformers"}
QUICK = ["train-fp32", "moe-bf16", "generate-b8", "eval", "checkpoint", "overhead", "fit"]


def _missing(group: str) -> str:
    """Why ``group`` cannot run here ("" if it can)."""
    needs = NEEDS.get(group.split("-")[0])
    if needs and not _peer_has(needs):
        return f"{needs} is not installed in {PEER_PYTHON} (set KILN_PEER_PYTHON)"
    if group == "eval" and not all(_peer_has(m, sys.executable) for m in ("lm_eval", "accelerate")):
        return "lm-eval and accelerate (the dev extra) are not installed here"
    return ""


@pytest.fixture(scope="module")
def quick_round(tmp_path_factory):
    """One tiny round of every group that can run here, in one bench_peers process (each side
    still in its own process, as in a real run, forked: tests/forked.py): (work folder, rows by
    group)."""
    work = tmp_path_factory.mktemp("bench_peers")
    runnable = [g for g in QUICK if not _missing(g)]
    if not runnable:
        return work, {}
    out = forked.run([sys.executable, str(SCRIPT), "--quick", "--rounds", "1", "--threads", "1",
                      *[x for g in runnable for x in ("--only", g)], "--json",
                      "--peer-python", PEER_PYTHON, "--work", str(work)], REPO, timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    rows: dict[str, list[dict]] = {}
    for row in json.loads(out.stdout)["rows"]:
        rows.setdefault(row["group"], []).append(row)
    assert sorted(rows) == sorted(runnable), sorted(rows)
    return work, rows


@pytest.mark.slow
@pytest.mark.parametrize("group", QUICK)
def test_one_quick_round(group, quick_round):
    if why := _missing(group):
        pytest.skip(why)
    work, by_group = quick_round
    rows = by_group[group]
    assert rows and all(not r["problem"] and r["speedup"] > 0 for r in rows), rows
    if group == "generate-b8":  # the profile docs/benchmarks.md quotes, on the same checkpoint
        prof = forked.run([sys.executable, str(REPO / "scripts" / "profile_generate.py"),
                           str(work / "generate"), "kiln", "--new-tokens", "4", "--threads", "1"],
                          REPO, timeout=600)
        assert prof.returncode == 0 and "aten::mm" in prof.stdout, prof.stderr[-3000:]

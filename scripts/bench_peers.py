"""kiln against what a user would pick instead, on every hot path, side by side: one table.

    python scripts/bench_peers.py --peer-python PEER_ENV/bin/python [--only NAME] [--rounds 3]

Rows (``--only`` takes a group name or its prefix, e.g. ``train``; ``--list`` lists them):

- ``train-*``: dense training step vs torchtitan 0.2.2's Llama 3 debugmodel, fp32 and bf16
  autocast, eager and compiled on both sides (``bench_rows/train.py``); ``train-fp32`` also gives
  the time to the first step (process start to the end of step 1; alias ``first-step``);
- ``moe-*``: one MoE layer's training step vs torchtitan's ``MoE`` module (``bench_rows/moe.py``);
- ``generate-b1``, ``generate-b8``: greedy tokens/s vs ``transformers`` ``generate`` on kiln's
  export of the same checkpoint, 256 new tokens, KV cache on both sides
  (``bench_rows/generate.py``);
- ``eval``: downstream multiple-choice scoring vs lm-evaluation-harness ``hf``
  (``bench_rows/eval.py``);
- ``checkpoint``: save and load MB/s of kiln's checkpoints vs bare DCP
  (``bench_rows/checkpoint.py``);
- ``overhead``: per-step time of kiln's trainer vs a plain loop on the same tiny model
  (``bench_rows/overhead.py``);
- ``mixture-loader``: a 3-source mixture's data loader vs one source, time per global step
  (``bench_rows/mixture.py``);
- ``sft-data``: chat rendering + assistant masks + tokenizing vs ``transformers``'
  ``apply_chat_template`` (``bench_rows/sft_data.py``);
- ``lora-step``, ``lora-memory``: a LoRA training step vs ``peft`` on ``transformers``, and its
  optimizer state vs full fine-tuning (``bench_rows/lora.py``, ``lora_memory.py``);
- ``dpo-step``, ``dpo-memory``: a DPO step vs TRL's ``DPOTrainer`` on ``transformers``, and the
  peak memory of a LoRA DPO step with the adapters-off reference vs a frozen copy
  (``bench_rows/dpo.py``, ``dpo_memory.py``);
- ``grpo-rollout``, ``grpo-step``: sampled rollouts (tokens/s) vs ``transformers`` ``generate``
  as TRL's ``GRPOTrainer`` calls it, and a whole GRPO step vs ``GRPOTrainer.training_step``
  (``bench_rows/grpo.py``);
- ``blocks-gpt-oss``, ``blocks-qwen3-next``: a training step of a 4-layer model of each
  style vs ``transformers``' on the same configuration (``bench_rows/blocks.py``);
- ``gpt2-model``, ``gpt2-loop``: a GPT-2 training step at nanoGPT's CPU size vs ``transformers``'
  ``GPT2LMHeadModel`` on the same weights, and kiln's trainer vs nanoGPT's loop around the same
  model, one thread (``bench_rows/gpt2.py``);
- ``fit``: ``kiln fit``'s scaling-law fit with 1,000 bootstrap refits vs the same refits one
  scipy L-BFGS call each (``bench_rows/fit.py``).

Every side runs in a fresh process; each round runs every group's two sides, the order of the two
alternating from round to round, so drift in the machine's load hits both. The table gives each
side's median and the median of the per-round ratios ("kiln speed-up": > 1 means kiln is faster),
with the date, the CPU model and the command, as Markdown ready to paste.

The peer environment (outside the repository) has torchtitan 0.2.2 (which imports triton even on a
CPU) and transformers next to the same torch::

    python -m venv --system-site-packages PEER_ENV
    PEER_ENV/bin/pip install torchtitan==0.2.2 triton

Third-party peers (torchtitan, transformers) run in ``--peer-python``; kiln's sides and the peers
that need only torch (bare DCP, the plain loop) run in this interpreter. A row whose peer is not
installed says so instead of failing the table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_rows.catalog import Group, Row, groups  # noqa: E402, F401 (the tests read them)
from bench_rows.common import REPO, Unavailable, cpu_model  # noqa: E402

ALIASES = {"first-step": "train-fp32"}


def select(all_groups: list[Group], only: list[str]) -> list[Group]:
    """The groups ``--only`` names: a group's exact name, else every group it is a prefix of."""
    if not only:
        return all_groups
    exact = {g.name for g in all_groups}

    def picks(name: str, g: Group) -> bool:
        return g.name == name if name in exact else g.name.startswith(name + "-")

    names = [ALIASES.get(n, n) for n in only]
    unknown = [n for n in names if not any(picks(n, g) for g in all_groups)]
    if unknown:
        sys.exit(f"--only {', '.join(unknown)}: unknown; choose from "
                 f"{', '.join([g.name for g in all_groups] + list(ALIASES))}")
    return [g for g in all_groups if any(picks(n, g) for n in names)]


# ------------------------------------------------------------------------------ running sides
def side_command(group: Group, who: str, args) -> list[str]:
    python = args.peer_python if who == "peer" and group.third_party else sys.executable
    return [python, str(Path(__file__).resolve()), "--side", group.module, "--who", who,
            "--params", json.dumps(group.params)]


def run_side(cmd: list[str]) -> dict:
    """The side's JSON result; {"unavailable": why} or {"error": tail} when it could not run."""
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode == 0 and lines:
        return json.loads(lines[-1])
    tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-15:])
    return {"error": f"exit {out.returncode}: {tail}"}


def side_main(module: str, who: str, params: dict) -> int:
    """In a side's own process: run it and print one JSON line."""
    mod = importlib.import_module(f"bench_rows.{module}")
    try:
        result = getattr(mod, who)(params)
    except Unavailable as exc:
        result = {"unavailable": str(exc)}
    print(json.dumps(result))
    return 0


def measure(chosen: list[Group], args, log=sys.stderr) -> dict:
    """Alternating rounds over every group; per group the side results of every round."""
    args.work.mkdir(parents=True, exist_ok=True)
    for module in sorted({g.module for g in chosen}):
        setup = getattr(importlib.import_module(f"bench_rows.{module}"), "setup", None)
        if setup is not None:
            setup(args.work / module)
            for g in chosen:
                if g.module == module:
                    g.params["work"] = str(args.work / module)
    results: dict[str, dict] = {g.name: {"kiln": [], "peer": [], "problem": ""} for g in chosen}
    for r in range(args.rounds):
        for g in chosen:
            res = results[g.name]
            if res["problem"]:
                continue
            if g.paired:
                if r == 0:
                    _paired(g, res, args)
                continue
            order = ["kiln", "peer"] if r % 2 == 0 else ["peer", "kiln"]
            got = {who: run_side(side_command(g, who, args)) for who in order}
            for who in order:
                if "unavailable" in got[who] or "error" in got[who]:
                    res["problem"] = got[who].get("unavailable") or (
                        f"{who} side failed: " + got[who]["error"])
            if not res["problem"]:
                res["kiln"].append(got["kiln"])
                res["peer"].append(got["peer"])
            print(f"round {r + 1}/{args.rounds} {g.name}: " + (res["problem"].splitlines()[0]
                  if res["problem"] else ", ".join(
                      f"{who} {got[who][row.metric]:,.4g} {row.unit}" for row in g.rows
                      for who in ("kiln", "peer"))), file=log, flush=True)
    return results


def _paired(g: Group, res: dict, args) -> None:
    mod = importlib.import_module(f"bench_rows.{g.module}")
    try:
        both = mod.both(g.params)
    except Unavailable as exc:
        res["problem"] = str(exc)
        return
    except RuntimeError as exc:
        res["problem"] = f"failed: {exc}"
        return
    res["kiln"].append(both["kiln"])
    res["peer"].append(both["peer"])


def summarise(chosen: list[Group], results: dict, args) -> dict:
    import torch

    rows = []
    for g in chosen:
        res = results[g.name]
        version = next((p["version"] for p in res["peer"] if "version" in p), "")
        for row in g.rows:
            line = {"group": g.name, "label": row.label, "unit": row.unit, "goal": row.goal,
                    "peer": g.peer + (f", {version}" if version else ""),
                    "problem": res["problem"], "rounds": len(res["kiln"])}
            if res["kiln"]:
                kiln = [k[row.metric] for k in res["kiln"]]
                peer = [p[row.metric] for p in res["peer"]]
                ratios = [(k / p if row.higher_is_better else p / k) for k, p in
                          zip(kiln, peer, strict=True)]
                line.update(kiln=statistics.median(kiln), peer_value=statistics.median(peer),
                            speedup=statistics.median(ratios))
                line["notes"] = _notes(g, res)
            threads = g.params.get("threads", args.threads)
            if threads != args.threads:  # a row that fixes its own count (nanoGPT's 1)
                line["notes"] = ", ".join(n for n in (f"{threads} thread"
                                                      f"{'s' if threads > 1 else ''} per side",
                                                      line.get("notes", "")) if n)
            rows.append(line)
    return {"date": datetime.date.today().isoformat(), "cpu": cpu_model(),
            "cores": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
            "rounds": args.rounds, "command": args.command, "rows": rows,
            "thread_env": {k: os.environ[k] for k in THREAD_ENV if k in os.environ}}


# Settings that change every row's speed on both sides: OMP_WAIT_POLICY=PASSIVE (idle OpenMP
# threads sleep) made each parallel matmul wake a sleeping thread, 5x the time of a batch-1
# decode projection on this 2-core VM (docs/benchmarks.md), so a table says which were set.
THREAD_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "KMP_BLOCKTIME", "OMP_PROC_BIND")


def _notes(g: Group, res: dict) -> str:
    """What a reader needs beside the numbers: kernels chosen, whether outputs agreed."""
    notes = []
    kernels = {(k.get("kernel"), p.get("kernel")) for k, p in zip(res["kiln"], res["peer"],
                                                                   strict=True)}
    if any(a or b for a, b in kernels):
        notes.append("experts: " + "; ".join(f"kiln {a}, peer {b}" for a, b in sorted(kernels)))
    if all("first_row" in x for x in res["kiln"] + res["peer"]):
        same = all(k["first_row"] == p["first_row"] for k, p in zip(res["kiln"], res["peer"],
                                                                    strict=True))
        notes.append("same tokens" if same else "tokens differ")
    return ", ".join(notes)


def _fmt(value: float, unit: str) -> str:
    if unit in ("s", "ms"):
        return f"{value:,.2f} {unit}" if value < 100 else f"{value:,.0f} {unit}"
    return f"{value:,.0f} {unit}" if value >= 100 else f"{value:,.1f} {unit}"


def render(s: dict) -> str:
    lines = [
        f"Measured {s['date']} on `{s['cpu']}` ({s['cores']} cores), {s['threads']} threads per "
        f"side (where a row's notes give no other count), torch {s['torch']}; "
        f"{s['rounds']} alternating rounds, medians; kiln speed-up = "
        "median of the per-round ratios (> 1: kiln faster). Threading environment: "
        + (", ".join(f"{k}={v}" for k, v in s["thread_env"].items())
           or f"library defaults (none of {', '.join(THREAD_ENV)} set)") + ".",
        "",
        f"Command: `{s['command']}`",
        "",
        "| row | kiln | peer | peer's | kiln speed-up | goal | notes |",
        "| --- | ---: | --- | ---: | ---: | ---: | --- |",
    ]
    for r in s["rows"]:
        if "speedup" in r:
            lines.append(f"| {r['label']} | {_fmt(r['kiln'], r['unit'])} | {r['peer']} | "
                         f"{_fmt(r['peer_value'], r['unit'])} | {r['speedup']:.2f}x | "
                         f"{r['goal'] or '-'} | {r['notes']} |")
        else:
            why = " ".join(r["problem"].split())[:300] or "not measured"
            lines.append(f"| {r['label']} | n/a | {r['peer']} | n/a | n/a | {r['goal'] or '-'} "
                         f"| {why} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peer-python", default=os.environ.get("KILN_PEER_PYTHON",
                                                                sys.executable),
                        help="python of the environment with torchtitan 0.2.2 and transformers")
    parser.add_argument("--only", action="append", default=[],
                        help="a group or prefix (train, moe-bf16, generate, ...); repeatable")
    parser.add_argument("--list", action="store_true", help="list the groups and exit")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--steps", type=int, default=20, help="measured steps (train, moe)")
    parser.add_argument("--warmup", type=int, default=3, help="unmeasured steps first")
    parser.add_argument("--new-tokens", type=int, default=256, help="generation length")
    parser.add_argument("--threads", type=int, default=min(os.cpu_count() or 1, 8),
                        help="intra-op threads on every side")
    parser.add_argument("--work", type=Path, default=REPO / "runs" / "bench_peers",
                        help="folder for the generation model and checkpoints")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, to check that every row runs (times nothing useful)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--who", choices=("kiln", "peer"), help=argparse.SUPPRESS)
    parser.add_argument("--params", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.side:
        return side_main(args.side, args.who, json.loads(args.params))
    all_groups = groups(args)
    if args.list:
        for g in all_groups:
            print(f"{g.name:20} vs {g.peer}: " + "; ".join(r.label for r in g.rows))
        return 0
    args.work = args.work.resolve()
    args.command = "python scripts/bench_peers.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    chosen = select(all_groups, args.only)
    summary = summarise(chosen, measure(chosen, args), args)
    print(json.dumps(summary) if args.json else render(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())

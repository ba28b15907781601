"""Train each recipe mutation ``kiln validate`` accepted for two steps, or resume a run with
it: what ``kiln train`` refuses that validate passed, a resume that does not say what changed,
and any raw exception, are reported.

    python scripts/fuzz_recipe.py train_configs/sft_debug.toml --switch --accepted acc.json
    python scripts/fuzz_train.py train_configs/sft_debug.toml acc.json [--one-per-key]
        [--jobs 2] [--base=--training.micro_batch=1 ...] [--resume-from RUN]

Each mutation runs as its own ``kiln train RECIPE --training.steps=2 --run.folder=TMP
--eval.at_end=false --checkpoint.enable=false BASE... MUTATION`` process (one thread each,
``--jobs`` at a time; a mutation of ``run.folder``, which the script sets, is left out). A run
that ends in kiln's one-line error is a refusal: most are the data checks ``fuzz_recipe.py``
leaves out without ``--data``, the non-finite first step of an absurd init, or the base's own
settings (``checkpoint.enable = false`` with ``training.max_hours``); each message is printed
once with how many runs gave it. A traceback is a bug (exit status 1). ``--one-per-key`` trains
one mutation per set of keys, the most extreme value first (1e30, -1, 0, ...): a recipe's 1,000
accepted mutations become about 300.

``--resume-from RUN``: each mutation resumes a copy of the run folder RUN (trained with the
recipe and ``--base`` overrides, which must then raise ``training.steps``) instead: a resume
must refuse the change in one line or resume and list every key it changed (``kiln diff``'s
keys); a run that starts over, or resumes without listing a changed key, is a bug too.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

# fuzz_recipe.py's values, most likely to break a run first
RANK = ("1e30", "-1", "0", "7", "2", "[1, 2]", "0.5", "true")
BASE = ["--training.steps=2", "--eval.at_end=false", "--checkpoint.enable=false"]


def one_per_key(mutations: list[list[str]]) -> list[list[str]]:
    """One mutation per set of keys: the one whose most extreme value ranks first."""
    def rank(mutation: list[str]) -> int:
        values = [m.split("=", 1)[1] for m in mutation]
        return min(RANK.index(v) if v in RANK else len(RANK) for v in values)

    best: dict[tuple[str, ...], list[str]] = {}
    for mutation in mutations:
        keys = tuple(m.split("=", 1)[0] for m in mutation)
        if keys not in best or rank(mutation) < rank(best[keys]):
            best[keys] = mutation
    return list(best.values())


def own_keys_left_out(mutations: list[list[str]]) -> list[list[str]]:
    """The mutations that leave ``run.folder`` alone: the script sets it (a fresh folder, or
    the copy to resume), and a mutation of it trains elsewhere, beside the working folder."""
    return [m for m in mutations if not any(x.split("=", 1)[0] == "--run.folder" for x in m)]


def classify(returncode: int, stderr: str) -> tuple[str, str]:
    """("ok" | "refused" | "raw", the line that says why)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    if returncode == 0:
        return "ok", ""
    if any(line.startswith("Traceback") for line in lines):
        return "raw", lines[-1] if lines else ""
    errors = [line for line in lines if line.startswith("kiln train: error: ")]
    return "refused", (errors or lines or [f"exit status {returncode}"])[-1]


def resumed(output: str, changed: list[str]) -> tuple[str, str]:
    """A finished resume: ("ok", "") when it says it resumed and lists every changed key."""
    if "kiln: resumed from " not in output:
        return "raw", "started over instead of resuming"
    listed = {line.strip().split(":", 1)[0] for line in output.splitlines()
              if line.startswith("  ")}
    unlisted = [key for key in changed if key not in listed]
    return ("raw", f"resumed without listing {', '.join(unlisted)}") if unlisted else ("ok", "")


def changed_keys(recipe: str, base: list[str], mutation: list[str]) -> list[str]:
    """The keys ``mutation`` changes in the resolved recipe (those ``kiln diff`` shows)."""
    from kiln.recipes.config.diff import diff
    from kiln.recipes.config.files import load_recipe

    with contextlib.redirect_stderr(io.StringIO()):  # notes of the loader, not wanted here
        return diff(load_recipe(recipe, base), load_recipe(recipe, [*base, *mutation])).keys()


def train(recipe: str, mutation: list[str], base: list[str], folder: str, timeout: float,
          resume_from: str = "") -> tuple[str, str]:
    fixed = [] if resume_from else BASE
    if resume_from:
        shutil.copytree(resume_from, folder, symlinks=True)
    argv = [sys.executable, "-m", "kiln.recipes.cli", "train", recipe, *fixed,
            f"--run.folder={folder}", *base, *mutation]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "raw", f"no result in {timeout:.0f} s"
    kind, why = classify(done.returncode, done.stderr)
    if kind == "ok" and resume_from:
        return resumed(done.stdout + done.stderr, changed_keys(recipe, base, mutation))
    return kind, why


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("accepted", help="fuzz_recipe.py --accepted FILE")
    parser.add_argument("--one-per-key", action="store_true",
                        help="one mutation per set of keys, the most extreme value")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--base", action="append", default=[],
                        help="an override every run starts from (repeatable)")
    parser.add_argument("--resume-from", default="",
                        help="resume a copy of this run folder with each mutation")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take")
    args = parser.parse_args(argv)
    with open(args.accepted) as f:
        mutations = json.load(f)
    mutations = own_keys_left_out(mutations)
    if args.one_per_key:
        mutations = one_per_key(mutations)
    with tempfile.TemporaryDirectory() as tmp:
        def one(item: tuple[int, list[str]]) -> tuple[str, str]:
            index, mutation = item
            folder = os.path.join(tmp, str(index))
            kind, why = train(args.recipe, mutation, args.base, folder, args.timeout,
                              args.resume_from)
            shutil.rmtree(folder, ignore_errors=True)
            return kind, why.replace(folder, "RUN_FOLDER")  # the same message, one line

        with ThreadPoolExecutor(max(1, args.jobs)) as pool:
            results = list(pool.map(one, enumerate(mutations)))
    refusals: collections.Counter[str] = collections.Counter()
    raw = 0  # a traceback; with --resume-from also a start-over or an unlisted change
    for mutation, (kind, why) in zip(mutations, results, strict=True):
        if kind == "raw":
            raw += 1
            print(f"RAW {' '.join(mutation)}: {why}")
        elif kind == "refused":
            refusals[why] += 1
    for why, count in refusals.most_common():
        print(f"REFUSED x{count}: {why}")
    ok = sum(kind == "ok" for kind, _ in results)
    done = "resumed" if args.resume_from else "trained"
    print(f"{len(mutations)} mutations {done}: {ok} ok, {sum(refusals.values())} refused by "
          f"train, {raw} bug(s)")
    return 1 if raw else 0


if __name__ == "__main__":
    sys.exit(main())

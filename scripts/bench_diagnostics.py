"""What module diagnostics cost: step times of one run, interleaved (side by side, so a busy box
slows every kind of step alike).

    python scripts/bench_diagnostics.py [RECIPE] [--steps 13] [--key=value ...]

Trains RECIPE (default train_configs/debug.toml) with ``[run.diagnostics] interval = 3``:
steps 3, 6, 9, ... are diagnostic steps, the step before each pays for arming them (the weight
copy for the update ratio), the step after is plain. The overhead of one diagnostic step is
(median arming step - median plain step) + (median diagnostic step - median plain step); at an
interval of N steps it adds that over N plain steps. Step 1 (warm-up) is left out. Prints one
table with the CPU model.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


class StepClock:
    """A hook (last in the list) noting when each step's hooks are done."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.start = 0.0

    def on_train_start(self, trainer) -> None:
        self.start = time.perf_counter()

    def on_step_end(self, trainer, result) -> None:
        self.ends.append(time.perf_counter())

    def on_train_end(self, trainer) -> None:
        pass

    def close(self, trainer) -> None:
        pass


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(x.split(":", 1)[1].strip() for x in out.splitlines()
                    if x.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", nargs="?", default=str(REPO / "train_configs" / "debug.toml"))
    parser.add_argument("--steps", type=int, default=13)
    args, overrides = parser.parse_known_args()
    from kiln.recipes.recipe import load_recipe
    from kiln.recipes.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(args.recipe, [
            *overrides, f"--training.steps={args.steps}", f"--run.folder={tmp}/run",
            "--run.diagnostics.interval=3", "--run.log_interval=1000000",
            "--run.progress_bar=false", "--eval.interval=0", "--eval.at_end=false",
            "--checkpoint.enable=false", "--run.tensorboard=true"])
        clock = StepClock()
        with open(os.devnull, "w") as sink:
            Trainer(recipe, hooks=[clock], checkpoints=False, out=sink).fit()
    times = [b - a for a, b in zip([clock.start, *clock.ends], clock.ends, strict=False)]
    kinds: dict[str, list[float]] = {"plain": [], "arming": [], "diagnostic": []}
    for step, t in enumerate(times, 1):
        if step == 1:
            continue
        kinds["diagnostic" if step % 3 == 0 else "arming" if step % 3 == 2 else "plain"].append(t)
    med = {k: statistics.median(v) for k, v in kinds.items()}
    extra = (med["arming"] - med["plain"]) + (med["diagnostic"] - med["plain"])
    print(f"{args.recipe} {' '.join(overrides)}  ({cpu_model()}, {os.cpu_count()} cores, "
          f"python {sys.version.split()[0]})")
    for kind, values in kinds.items():
        print(f"  {kind:<10} steps: median {med[kind]:.3f} s over {len(values)}")
    print(f"  one diagnostic step adds {extra:.3f} s = {extra / med['plain']:.1%} of a step; "
          f"at interval 100: {extra / med['plain'] / 100:.2%}, at interval 10: "
          f"{extra / med['plain'] / 10:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

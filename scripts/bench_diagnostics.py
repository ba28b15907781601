"""What module diagnostics cost: the time spent inside them, against plain steps of the same run.

    python scripts/bench_diagnostics.py [RECIPE] [--steps 31] [--key=value ...]

Trains RECIPE (default train_configs/debug.toml) with ``[run.diagnostics] interval = 3`` and
times every piece of diagnostics work (the module hooks' figures, arming with its weight copy,
reducing and logging), outermost calls only. On CPU the work is synchronous, so this is its
cost; comparing whole step times instead drowns it in the noise of a shared box. The plain-step
time is the median over the steps that are neither diagnostic (3, 6, ...) nor the one before
(arming), step 1 (warm-up) left out. Prints one table with the CPU model.
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


class Stopwatch:
    """Wraps functions; sums the time of outermost calls, per training step."""

    def __init__(self) -> None:
        self.depth = 0
        self.by_step: dict[int, float] = {}
        self.step = 0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            self.depth += 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    self.by_step[self.step] = self.by_step.get(self.step, 0.0) + (
                        time.perf_counter() - start)
        return timed


class StepClock:
    """A hook (last in the list) noting when each step's hooks are done; it tells the stopwatch
    which step the work that follows belongs to."""

    def __init__(self, watch: Stopwatch) -> None:
        self.ends: list[float] = []
        self.start = 0.0
        self.watch = watch

    def on_train_start(self, trainer) -> None:
        self.start = time.perf_counter()
        self.watch.step = trainer.progress.step + 1

    def on_step_end(self, trainer, result) -> None:
        self.ends.append(time.perf_counter())
        self.watch.step = trainer.progress.step + 1

    def on_train_end(self, trainer) -> None:
        pass

    def close(self, trainer) -> None:
        pass


def instrument(watch: Stopwatch) -> None:
    from kiln.recipes.hooks import diagnostics as d

    for name in ("attention_logit_stats", "router_entropy", "_moments"):
        setattr(d, name, watch.wrap(getattr(d, name)))
    for name in ("on_step_end", "_on_loop", "maybe_arm"):
        setattr(d.DiagnosticsHook, name, watch.wrap(getattr(d.DiagnosticsHook, name)))


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
    from kiln.recipes.config.files import load_recipe
    from kiln.recipes.training.trainer import Trainer

    watch = Stopwatch()
    instrument(watch)
    with tempfile.TemporaryDirectory() as tmp:
        recipe = load_recipe(args.recipe, [
            *overrides, f"--training.steps={args.steps}", f"--run.folder={tmp}/run",
            "--run.diagnostics.interval=3", "--run.log_interval=1000000",
            "--run.progress_bar=false", "--eval.interval=0", "--eval.at_end=false",
            "--checkpoint.enable=false", "--run.tensorboard=true"])
        clock = StepClock(watch)
        with open(os.devnull, "w") as sink:
            Trainer(recipe, hooks=[clock], checkpoints=False, out=sink).fit()
    times = [b - a for a, b in zip([clock.start, *clock.ends], clock.ends, strict=False)]
    plain = statistics.median(t for step, t in enumerate(times, 1) if step > 1 and step % 3 == 1)
    # hook time of a diagnostic cycle: the step before (arming, at its end) + the step itself
    cycles = [watch.by_step.get(s - 1, 0.0) + watch.by_step.get(s, 0.0)
              for s in range(3, args.steps + 1, 3)]
    cost = statistics.median(cycles)
    print(f"{args.recipe} {' '.join(overrides)}  ({cpu_model()}, {os.cpu_count()} cores, "
          f"python {sys.version.split()[0]})")
    print(f"  plain step: median {plain:.3f} s; diagnostics work per diagnostic step: median "
          f"{cost:.3f} s over {len(cycles)} ({', '.join(f'{c:.3f}' for c in cycles)})")
    print(f"  one diagnostic step adds {cost / plain:.1%} of a step; at interval 100: "
          f"{cost / plain / 100:.2%}, at interval 10: {cost / plain / 10:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does the best learning rate transfer across width? A grid of AdamW learning rates at width 64
and at width 256 (kiln ladder's size rule at fixed depth), under the standard parametrization
and under µP with base_dim 64 (so at width 64 the two are the same model); each run's held-out
loss at its end, and the best LR per column. docs/scaling.md quotes its output.

    python scripts/mup_transfer.py --steps 200 --out /tmp/mup_transfer [--seed 1]

Each run is a normal kiln run folder under --out (rerunning skips the finished ones).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from kiln.recipes.config.files import load_recipe
from kiln.recipes.scaling.ladder import size_values

RECIPE = Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml"
LRS = [1.25e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3, 1.6e-2, 3.2e-2]


def eval_loss(folder: Path) -> float | None:
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        return None
    losses = [json.loads(line).get("eval/loss") for line in metrics.read_text().splitlines()]
    losses = [v for v in losses if v is not None]
    return losses[-1] if losses else None


def train(folder: Path, width: int, lr: float, parametrization: str, steps: int,
          seed: int) -> float:
    from kiln.recipes.training.trainer import Trainer

    if (done := eval_loss(folder)) is not None:
        return done
    base = load_recipe(RECIPE)
    sized = [f"--{k}={v}" for k, v in size_values(base, width, "fixed")]
    recipe = load_recipe(RECIPE, [
        *sized, f"--model.parametrization={parametrization}", "--model.base_dim=64",
        f"--optimizer.lr={lr}", f"--training.steps={steps}", "--training.seq_len=128",
        f"--training.seed={seed}",
        "--optimizer.schedule.warmup_steps=20", "--eval.interval=0", "--eval.tokens=32768",
        "--checkpoint.enable=false", "--run.progress_bar=false", "--run.tensorboard=false",
        f"--run.folder={json.dumps(str(folder))}"])
    with open(os.devnull, "w") as sink:
        Trainer(recipe, hooks=[], out=sink).fit()
    return eval_loss(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", default="/tmp/mup_transfer")
    parser.add_argument("--seed", type=int, default=0, help="training.seed (init and data order)")
    args = parser.parse_args()
    out, start = Path(args.out), time.perf_counter()
    columns = {"width 64 (both)": (64, "standard"), "width 256 standard": (256, "standard"),
               "width 256 mup": (256, "mup")}
    results: dict[str, list[float]] = {}
    for name, (width, param) in columns.items():
        tag = f"-seed{args.seed}" if args.seed else ""  # seed 0: the folders of the first run
        results[name] = [train(out / f"w{width}-{param}-lr{lr:g}{tag}", width, lr, param,
                               args.steps, args.seed) for lr in LRS]
    print(f"held-out loss after {args.steps} steps (debug.toml, seq 128, batch 8; µP base_dim "
          f"64; seed {args.seed})")
    print(f"{'lr':>8}  " + "  ".join(f"{c:>18}" for c in columns))
    for i, lr in enumerate(LRS):
        print(f"{lr:>8g}  " + "  ".join(f"{results[c][i]:>18.4f}" for c in columns))
    best = {c: LRS[min(range(len(LRS)), key=lambda i: results[c][i])] for c in columns}
    print(f"{'best':>8}  " + "  ".join(f"{best[c]:>18g}" for c in columns))
    for c in list(columns)[1:]:
        shift = abs(LRS.index(best[c]) - LRS.index(best["width 64 (both)"]))
        print(f"{c}: best LR {shift} grid step(s) from width 64's")
    print(f"({time.perf_counter() - start:.0f} s, {os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()

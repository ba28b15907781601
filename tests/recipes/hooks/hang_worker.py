"""Run by tests/recipes/hooks/test_watchdog.py (alone, or under ``kiln.recipes.runs.launch``): a
tiny run
in which one rank stalls inside a step until the hang watchdog ends the process.

``python tests/recipes/hooks/hang_worker.py RUN_FOLDER STALL_RANK STALL_STEP [--key=value ...]``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer

CONFIGS = Path(__file__).resolve().parents[3] / "train_configs"
TINY = [
    "--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
    "--model.ffn.hidden_dim=64", "--training.seq_len=32", "--training.global_batch=4",
    "--training.micro_batch=2", "--training.steps=8", "--data.max_bytes=300000",
    "--data.eval_fraction=0.2", "--run.log_interval=1", "--run.progress_bar=false",
    "--run.tensorboard=false", "--eval.interval=0", "--eval.at_end=false",
    "--checkpoint.interval=2", "--run.health_check.size_mb=0.25",
    "--run.watchdog.factor=10", "--run.watchdog.min_s=5", "--run.watchdog.poll_s=0.5",
    "--run.watchdog.grace_s=60",
]


def main(folder: str, stall_rank: int, stall_step: int, extra: list[str]) -> None:
    recipe = load_recipe(CONFIGS / "debug.toml", [*TINY, f"--run.folder={folder}", *extra])
    trainer = Trainer(recipe)
    real_step = trainer.step_fn

    def step(ctx, micro):
        if ctx.world.rank == stall_rank and ctx.step + 1 == stall_step:
            time.sleep(600)  # a stall inside the step: only the watchdog ends it
        return real_step(ctx, micro)

    trainer.step_fn = step
    trainer.fit()
    print("not reached: the run finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:])

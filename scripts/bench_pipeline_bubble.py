"""Measure the pipeline bubble: the share of each rank's step time spent outside its stages'
forward and backward (waiting for a neighbour, plus the transfers), for ``pp = 2`` on gloo
processes, per schedule and micro-batch count; prints one table beside the timetable's figure.

    python scripts/bench_pipeline_bubble.py [--recipe train_configs/debug.toml] [--steps 8]

Each process runs one thread. Steps 3.. are measured (the first builds the schedule). The
per-stage compute is timed around ``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``
/ ``backward_weight_one_chunk``; the step time around the schedule's runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CASES = [(schedule, micro_batch) for micro_batch in (4, 2, 1)
         for schedule in ("gpipe", "1f1b", "interleaved_1f1b")]


def _timed(cls, name: str, box: dict) -> None:
    real = getattr(cls, name)

    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            box["busy"] += time.perf_counter() - start

    setattr(cls, name, wrapper)


def _worker(rank: int, port: int, recipe: str, steps: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from kiln.components import distributed
    from kiln.parallelisms.pipeline.stages import Pipeline
    from kiln.recipes.config.files import load_recipe
    from kiln.recipes.training.trainer import Trainer

    box = {"busy": 0.0, "total": 0.0, "step": 0, "rows": []}
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        _timed(_PipelineStageBase, name, box)
    real_train = Pipeline.train

    def train(self, *args, **kwargs):
        box["busy"], start = 0.0, time.perf_counter()
        result = real_train(self, *args, **kwargs)
        box["step"] += 1
        if box["step"] > 2:
            box["rows"].append((box["busy"], time.perf_counter() - start))
        return result

    Pipeline.train = train
    table = {}
    for schedule, mb in CASES:
        box["step"], box["rows"] = 0, []
        with tempfile.TemporaryDirectory() as tmp:
            r = load_recipe(recipe, [
                f"--training.steps={steps}", f"--training.micro_batch={mb}",
                "--parallelism.pp=2", f"--parallelism.pp_schedule={schedule}",
                "--checkpoint.enable=false", "--eval.at_end=false", "--eval.interval=0",
                "--run.progress_bar=false", "--run.tensorboard=false", f"--run.folder={tmp}"])
            with open(os.devnull, "w") as sink:
                trainer = Trainer(r, out=sink)
                trainer.fit()
            n = trainer.plan.grad_accum
        busy = sum(b for b, _ in box["rows"])
        total = sum(t for _, t in box["rows"])
        table[f"{schedule} {n}"] = {"bubble": 1 - busy / total, "step_s": total / len(box["rows"])}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(table, f)
    distributed.shutdown()


def main() -> None:
    from kiln.parallelisms.config import ParallelismConfig
    from kiln.parallelisms.pipeline.schedule import bubble_fraction
    from tests.parallelisms.tiny import free_port

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="train_configs/debug.toml")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as out:
        torch.multiprocessing.spawn(_worker, args=(free_port(), args.recipe, args.steps, out),
                                    nprocs=2)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]
    print("schedule          micro-batches  measured bubble (rank 0 / rank 1)  step s  timetable")
    for key in ranks[0]:
        schedule, n = key.split()
        plan = bubble_fraction(ParallelismConfig(pp=2, pp_schedule=schedule), int(n))
        a, b = ranks[0][key], ranks[1][key]
        print(f"{schedule:<17} {n:>13}  {a['bubble']:>17.1%} / {b['bubble']:.1%}"
              f"  {(a['step_s'] + b['step_s']) / 2:>14.2f}  {plan:>9.1%}")


if __name__ == "__main__":
    main()

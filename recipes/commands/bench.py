"""`kiln bench RECIPE [--steps N] [--warmup N] [--json]`: train the recipe briefly without
checkpoints, evaluation or logging and report speed, MFU and memory in one table."""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

import torch

from kiln.checkpointing.unattended.clock import process_age_s
from kiln.components import devices
from kiln.components.devices import pick_device
from kiln.components.errors import RecipeError
from kiln.components.models.block import padded_vocab
from kiln.components.protocols import Hook
from kiln.components.steps.bptt_memory import loop_memory
from kiln.recipes.config.files import load_recipe
from kiln.recipes.probes.flops import mfu
from kiln.recipes.probes.process_stats import peak_memory_bytes

_BENCH_OVERRIDES = [
    "--run.tensorboard=false", "--run.progress_bar=false", "--eval.interval=0",
    "--eval.at_end=false", "--checkpoint.enable=false",
]

TAKES_OVERRIDES = True  # kiln --help of the command shows them (recipes/cli.py)


def add_arguments(parser) -> None:
    parser.add_argument("recipe", help="recipe file")
    parser.add_argument("--steps", type=int, default=20,
                        help="measured steps (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=3,
                        help="unmeasured steps first (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--loops", default="", help="looped models: peak activation memory of "
                        "one step at each H (e.g. 4,8,16), segment length K from the recipe")


class _Timer(Hook):
    """A hook recording when each step ends and the trainer's data wait by then."""

    def __init__(self):
        self.ends: list[float] = []
        self.waits: list[float] = []
        self.ran: list[float] = []  # tokens the step's forwards computed (what MFU counts)

    def on_train_start(self, trainer) -> None:
        self.fit_start = time.perf_counter()

    def on_step_end(self, trainer, result) -> None:
        devices.synchronize(trainer.device)
        self.ends.append(time.perf_counter())
        self.waits.append(trainer.data_wait_s)
        self.ran.append(result.tokens if result.flop_tokens is None else result.flop_tokens)


def measure(recipe_path: str, overrides: list[str], steps: int, warmup: int) -> dict:
    start = time.perf_counter()
    age = _age_at(start)  # read once: /proc/uptime has 10 ms ticks, two reads may disagree
    startup = {"interpreter, imports": age}
    from kiln.recipes.training.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        total = warmup + steps
        startup["interpreter, imports"] += time.perf_counter() - start
        mark = time.perf_counter()
        recipe = load_recipe(recipe_path, [
            *overrides, *_BENCH_OVERRIDES, f"--training.steps={total}", f"--run.folder={tmp}",
            "--run.log_interval=1000000",
        ])
        startup["recipe"] = time.perf_counter() - mark
        timer = _Timer()
        with open(os.devnull, "w") as sink:
            trainer = Trainer(recipe, checkpoints=False, out=sink)
            # First of the hooks: a step ends before the others run, so the log line of the
            # last step is not timed. (The peak for MFU is found at the start: a cached
            # number, or once per machine a ~1-2 s probe counted in "first step".)
            trainer.hooks.insert(0, timer)
            startup.update(trainer.startup_s)
            devices.reset_peak_memory(trainer.device)
            trainer.fit()
    ends = timer.ends
    startup["first step"] = ends[0] - timer.fit_start
    first = ends[0] - start + age
    window = ends[warmup:] if warmup < len(ends) else ends
    step_time = (window[-1] - (ends[warmup - 1] if warmup else start)) / len(window)
    waits = timer.waits
    data_wait = (waits[-1] - (waits[warmup - 1] if warmup else 0.0)) / len(window)
    tokens_per_s = trainer.plan.tokens_per_step / step_time
    # FLOPs of what ran: steps that compute fewer tokens than the batch holds (cut padding,
    # prompts shared by a group) report them as StepResult.flop_tokens
    ran = sum(timer.ran[warmup:] if warmup < len(ends) else timer.ran) / len(window)
    achieved = trainer.flops_per_token * ran / step_time
    peak = trainer.peak_flops * trainer.world.world_size
    state = optimizer_state_bytes(trainer)
    result = {
        "recipe": recipe_path,
        "parallelism": trainer.parallel_summary,
        "params": trainer.num_params,  # the whole model (a pipeline rank holds a part)
        "tokens_per_step": trainer.plan.tokens_per_step,
        "tokens_per_second": tokens_per_s,
        "computed_tokens_per_step": ran,
        "step_time_s": step_time,
        "data_wait_s": data_wait,
        "data_wait_fraction": data_wait / step_time,
        "flops_per_token": trainer.flops_per_token,
        "achieved_flops": achieved,
        "peak_flops": peak,
        "mfu": mfu(achieved, peak),  # not clipped: above 1 the peak is wrong (printed)
        "peak_memory_bytes": peak_memory_bytes(trainer.device),
        "optimizer_state_bytes": sum(state.values()),
        "optimizer_state_bytes_by_optimizer": state,
        "time_to_first_step_s": first,
        "startup_s": startup,
        "device": str(trainer.device),
        "threads": torch.get_num_threads(),
        "rank": trainer.world.rank,
    }
    return result


def _age_at(moment: float) -> float:
    """Seconds from process start to ``moment`` (perf_counter), so time to first step includes
    the interpreter start and the imports; 0 where /proc is missing."""
    return max(process_age_s() - (time.perf_counter() - moment), 0.0)


def optimizer_state_bytes(trainer) -> dict[str, int]:
    """Optimizer-state bytes per optimizer of the run (quantised states at their real size)."""
    from kiln.components.optimizers.common import optimizer_state_bytes as state_bytes

    return {name: state_bytes(opt) for name, opt in trainer.optimizers.optimizers.items()}


def render(r: dict) -> str:
    mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
    if r["mfu"] is not None and r["mfu"] > 1:
        mfu += " (above 100%: the peak is too low for this device)"
    rows = [
        ("recipe", r["recipe"]),
        ("parallelism", r["parallelism"]),
        ("device / threads", f"{r['device']} / {r['threads']}"),
        ("parameters", f"{r['params']:,}"),
        ("tokens/s", f"{r['tokens_per_second']:,.0f}"),
        ("step time", f"{r['step_time_s'] * 1000:.1f} ms ({r['tokens_per_step']:,} tokens/step"
         + (f", {r['computed_tokens_per_step']:,.0f} computed)"
            if r["computed_tokens_per_step"] < r["tokens_per_step"] else ")")),
        ("model FLOPs/token", f"{r['flops_per_token']:.4g}"),
        ("achieved FLOP/s", f"{r['achieved_flops'] / 1e9:.1f} GFLOP/s"),
        ("peak FLOP/s", f"{r['peak_flops'] / 1e9:.1f} GFLOP/s"
         + (" (matmul probe, training dtype)" if r["device"] == "cpu" else " (datasheet bf16)")),
        ("MFU", mfu),
        ("peak memory", f"{r['peak_memory_bytes'] / 2**20:,.0f} MiB"
         + (" (process RSS)" if r["device"] == "cpu" else " (CUDA max allocated)")),
        ("optimizer state", f"{r['optimizer_state_bytes'] / 2**20:,.2f} MiB ("
         + ", ".join(f"{k} {v / 2**20:,.3f}" for k, v in
                     r["optimizer_state_bytes_by_optimizer"].items()) + ")"),
        ("data wait", f"{r['data_wait_s'] * 1000:.2f} ms/step "
         f"({r['data_wait_fraction']:.2%} of the step)"),
        ("time to first step", f"{r['time_to_first_step_s']:.2f} s (process start to the end "
         "of step 1):"),
        *((f"  {name}", f"{secs:.2f} s") for name, secs in r["startup_s"].items()),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def bench_loops(recipe_path: str, overrides: list[str], loops: str,
                batch: int = 0) -> list[dict[str, Any]]:
    """``kiln bench RECIPE --loops 4,8,16``: the recipe's model and micro-batch at each H, with
    the recipe's segment length K (``training.step.segment_loops``; all H for other steps)."""
    recipe = load_recipe(recipe_path, overrides)
    if "loops" not in type(recipe.model).model_fields:
        raise RecipeError(f"--loops needs a looped model; model.type = {recipe.model.type!r}")
    try:
        values = [int(x) for x in loops.split(",") if x.strip()]
    except ValueError:
        raise RecipeError(f"--loops {loops!r}: give comma-separated integers") from None
    tokenizer = recipe.tokenizer.build()
    tr = recipe.training
    device = pick_device(tr.device)
    vocab = padded_vocab(recipe.model, tokenizer.vocab_size)
    return loop_memory(recipe.model, vocab_size=vocab, seq_len=tr.seq_len,
                       batch=batch or tr.micro_batch, loops=values,
                       segment_loops=getattr(tr.step, "segment_loops", 0),
                       device=str(device), seed=tr.seed)


def run(args) -> int:
    if args.loops:
        from kiln.components.steps.bptt_memory import render as render_loops

        rows = bench_loops(args.recipe, args.overrides, args.loops)
        print(json.dumps(rows) if args.json else render_loops(rows))
        return 0
    result = measure(args.recipe, args.overrides, args.steps, args.warmup)
    if result["rank"] != 0:
        return 0
    print(json.dumps(result) if args.json else render(result))
    return 0

"""Periodic work around the step: logging, progress bar, evaluation. Checkpointing and other
packages add their own hooks. A hook overrides any of the three methods."""

from __future__ import annotations

import math
import sys
import time

import torch

from kiln.components import distributed as dist_utils
from kiln.recipes.flops import mfu
from kiln.recipes.process_stats import peak_memory_bytes


class Hook:
    def on_train_start(self, trainer) -> None:
        pass

    def on_step_end(self, trainer, result) -> None:
        pass

    def on_train_end(self, trainer) -> None:
        pass

    def close(self, trainer) -> None:
        """Always called last, also when training raised: release what the hook holds."""


class LogHook(Hook):
    """Console line, JSONL and TensorBoard every ``run.log_interval`` steps, and at step 1 (the
    untrained loss, ln(vocabulary) for a fresh model) and the last step."""

    def __init__(self):
        self._t0 = 0.0
        self._tokens0 = 0
        self._losses: list[float] = []
        self._over = False

    def on_train_start(self, trainer) -> None:
        # The peak for MFU (its notice line) now, before any step or checkpoint line; a
        # measured peak is cached per machine (flops.py), so this costs ~1 s once.
        trainer.peak_flops  # noqa: B018 - a cached property: found and printed once
        self._t0 = time.perf_counter()
        self._tokens0 = trainer.progress.tokens

    def on_step_end(self, trainer, result) -> None:
        self._losses.append(result.loss)
        step = trainer.progress.step
        if step % trainer.recipe.run.log_interval and step not in (1, trainer.total_steps):
            return
        now = time.perf_counter()
        elapsed = max(now - self._t0, 1e-9)
        tps = (trainer.progress.tokens - self._tokens0) / elapsed
        values = {
            "loss": result.loss,
            "loss_avg": sum(self._losses) / len(self._losses),
            "tokens_per_second": tps,
            "tokens_seen": trainer.progress.tokens,
            "interval_s": elapsed,  # summed by `kiln compare` / `kiln plot --x time`
        }
        if result.grad_norm is not None:
            values["grad_norm"] = result.grad_norm
        if trainer.peak_flops:
            per_rank = tps / trainer.world.world_size
            value = mfu(trainer.flops_per_token * per_rank, trainer.peak_flops)
            if value is not None:
                values["mfu"] = value
            elif not self._over:  # above 100%: the peak cannot be right
                self._over = True
                trainer.print(f"warning: MFU above 100% against {trainer.peak_flops / 1e12:.4g} "
                              "TFLOP/s: that peak is too low for this device; MFU not logged")
        values.update({f"lr/{k}": v for k, v in trainer.optimizers.lrs().items()})
        values.update(result.metrics)
        values.update(getattr(trainer.model, "metrics", dict)())  # e.g. expert loads
        for guard in trainer.guards.values():  # skip counters, baselines
            values.update(getattr(guard, "metrics", dict)())
        values["memory_bytes"] = peak_memory_bytes(trainer.device)
        trainer.metrics.log(step, values)
        if trainer.world.is_main:
            skip = f"  skipped: {result.reason}" if result.skipped else ""
            mfu_text = f"  mfu {values['mfu']:.1%}" if "mfu" in values else ""
            gn = f"  grad_norm {result.grad_norm:.3f}" if result.grad_norm is not None else ""
            trainer.print(
                f"step {step:>6}/{trainer.total_steps}  loss {result.loss:.4f}{gn}  "
                f"tok/s {tps:,.0f}{mfu_text}{skip}"
            )
        self._t0, self._tokens0, self._losses = now, trainer.progress.tokens, []


class ProgressHook(Hook):
    """A tqdm bar on the main rank: steps, loss, tokens/s, ETA. Only on a terminal: in a file or
    a pipe its redraws would be carriage-return frames in the log, where the log lines every
    ``run.log_interval`` steps already show the progress."""

    def __init__(self):
        self.bar = None

    def on_train_start(self, trainer) -> None:
        if trainer.world.is_main and trainer.recipe.run.progress_bar and _on_terminal(trainer):
            from tqdm import tqdm

            self.bar = tqdm(total=trainer.total_steps, initial=trainer.progress.step,
                            unit="step", dynamic_ncols=True, leave=True, file=sys.stderr)

    def on_step_end(self, trainer, result) -> None:
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{result.loss:.4f}", refresh=False)
            self.bar.update(1)

    def close(self, trainer) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _on_terminal(trainer) -> bool:
    """The bar goes to stderr, the log lines to ``trainer.out``: both must be terminals."""
    return all(getattr(stream, "isatty", lambda: False)() for stream in (sys.stderr, trainer.out))


class EvalHook(Hook):
    """Held-out loss every ``eval.interval`` steps and at the end, within a token budget."""

    def on_step_end(self, trainer, result) -> None:
        cfg, step = trainer.recipe.eval, trainer.progress.step
        at_end = cfg.at_end and step == trainer.total_steps  # done once, by on_train_end
        if cfg.interval and step % cfg.interval == 0 and not at_end:
            self.evaluate(trainer)

    def on_train_end(self, trainer) -> None:
        if trainer.recipe.eval.at_end and not trainer.stop_requested:
            self.evaluate(trainer)

    def evaluate(self, trainer) -> float:
        loss = evaluate(trainer, trainer.recipe.eval.tokens)
        values = {"eval/loss": loss}
        bpb = bits_per_byte(loss, trainer.dataset)
        if bpb is not None:
            values["eval/bpb"] = bpb
        trainer.metrics.log(trainer.progress.step, values)
        trainer.last_eval_loss = loss
        if trainer.world.is_main:
            tail = f"  bpb {bpb:.4f}" if bpb is not None else ""
            trainer.print(f"eval  step {trainer.progress.step}  loss {loss:.4f}  "
                          f"ppl {math.exp(min(loss, 50)):.2f}{tail}")
        return loss


def bits_per_byte(loss: float, dataset) -> float | None:
    """Bits per UTF-8 byte of the eval text: comparable across tokenizers, unlike the loss per
    token. ``loss`` (nats per token) times the eval split's tokens per byte, over ln 2; None
    when the dataset does not know its byte counts."""
    ratio = getattr(dataset, "tokens_per_byte", None)
    ratio = ratio("eval") if ratio is not None else None
    return loss * ratio / math.log(2) if ratio else None


def eval_loader(trainer):
    """The eval split's loader of this rank: micro_batch rows per data-parallel rank per batch
    (tensor-parallel peers share batches). The trainer builds one at start-up too, so a split
    too small for one batch stops the run before step 1, not after the last."""
    return trainer.dataset.loader(
        "eval", micro_batch=trainer.plan.micro_batch, global_batch=trainer.plan.micro_batch
        * trainer.data_ranks, rank=trainer.data_rank, world_size=trainer.data_ranks,
    )


@torch.no_grad()
def evaluate(trainer, token_budget: int) -> float:
    """Mean loss over the eval split's first ``token_budget`` tokens (all ranks together)."""
    model = trainer.model
    was_training = model.training
    model.eval()
    loader = eval_loader(trainer)
    total = torch.zeros(2, dtype=torch.float64, device=trainer.device)
    per_batch = trainer.plan.micro_batch * trainer.plan.seq_len * trainer.data_ranks
    for i, batch in enumerate(loader):
        if i * per_batch >= token_budget:
            break
        batch = trainer.to_device(batch)
        loss = trainer.forward_loss(batch)
        total[0] += loss.double() * batch["labels"].numel()
        total[1] += batch["labels"].numel()
    dist_utils.all_reduce_(total)
    model.train(was_training)
    return float(total[0] / total[1]) if total[1] > 0 else float("nan")

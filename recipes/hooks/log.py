"""The log line: console, JSONL and TensorBoard every ``run.log_interval`` steps."""

from __future__ import annotations

import time

from kiln.components.protocols import Hook
from kiln.recipes.probes.flops import mfu, trainer_peak
from kiln.recipes.probes.process_stats import peak_memory_bytes


class LogHook(Hook):
    """Console line, JSONL and TensorBoard every ``run.log_interval`` steps, and at step 1 (the
    untrained loss, ln(vocabulary) for a fresh model) and the last step."""

    priority = 70

    def __init__(self):
        self._t0 = 0.0
        self._tokens0 = 0
        self._flop_tokens = 0.0  # since the last line: what MFU counts (StepResult.flop_tokens)
        self._losses: list[float] = []
        self._over = False

    def on_train_start(self, trainer) -> None:
        # The peak for MFU (its notice line) now, before any step or checkpoint line; a
        # measured peak is cached per machine (flops.py), so this costs ~1 s once.
        trainer.peak_flops  # noqa: B018 - a cached property: found and printed once
        self._t0 = time.perf_counter()
        self._tokens0 = trainer.progress.tokens

    def _mfu(self, trainer, achieved: float) -> dict[str, float]:
        """MFU and the peak it is taken against (TFLOP/s per device), never clipped. Above 100%
        the peak is wrong: a measured one is measured again once, and a line says so."""
        value = mfu(achieved, trainer.peak_flops)
        if value > 1.0 and not self._over:
            self._over = True
            trainer.print(f"warning: MFU {value:.0%} against {trainer.peak_flops / 1e12:.4g} "
                          "TFLOP/s: that peak is too low for this device; measuring it again")
            trainer.peak_flops = trainer_peak(trainer, at_least=achieved)
            value = mfu(achieved, trainer.peak_flops)
            if value > 1.0:
                trainer.print(f"warning: MFU {value:.0%} still above 100%: the peak "
                              "(datasheet or probe) is wrong for this device; MFU is logged "
                              "as computed, with the peak beside it")
        return {"mfu": value, "mfu_peak_tflops": trainer.peak_flops / 1e12}

    def on_step_end(self, trainer, result) -> None:
        self._losses.append(result.loss)
        ran = result.flop_tokens
        self._flop_tokens += result.tokens if ran is None else ran
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
        if result.flop_tokens is not None:  # what the forwards ran, per step (MFU counts it)
            values["flop_tokens"] = self._flop_tokens / len(self._losses)
        if trainer.peak_flops:
            values.update(self._mfu(trainer, trainer.flops_per_token * self._flop_tokens
                                    / elapsed / trainer.world.world_size))
        values.update({f"lr/{k}": v for k, v in trainer.optimizers.lrs().items()})
        values.update(result.metrics)
        values.update(trainer.model.metrics())  # e.g. expert loads
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
        self._flop_tokens = 0.0

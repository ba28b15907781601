"""Per-source training figures of a mixture (``data.type = "mixture"``), every logged step.

On the steps the log line is written (``run.log_interval``, step 1 and the last):

- ``data/tokens/NAME``: tokens the source has given so far in the run (its sequences times
  ``training.seq_len``, less the tokens a context warmup cut: the ones trained on);
- ``data/share/NAME``: its share of the sequences since the previous logged step;
- ``train/loss/NAME``: the mean loss over its tokens since the previous logged step, all ranks
  (token-weighted: sums of token losses and counts, one all-reduce), where the trainer can
  measure it (not under pipeline parallelism or loss parallel: the start-up log says so).

The evaluation per source (``eval/loss/NAME``, ``eval/bpb/NAME``) is the eval hook's.
"""

from __future__ import annotations

import numpy as np

from kiln.components import distributed
from kiln.components.protocols import Hook


class SourceMetricsHook(Hook):
    """``data/tokens/NAME``, ``data/share/NAME`` and ``train/loss/NAME`` of a mixture."""

    priority = 69  # just after the log line, on the same steps

    def __init__(self) -> None:
        self.names: list[str] = []
        self._before: dict[str, int] = {}
        self._cut = None  # tokens a context warmup cut per source, in steps [0, _cut_to)
        self._cut_to = 0

    def on_train_start(self, trainer) -> None:
        self.names = list(trainer.dataset.source_names)
        if self.names:
            self._before = trainer.train_loader.source_counts()  # after a resume: the cursor's
            self._cut, self._cut_to = np.zeros(len(self.names), dtype=np.int64), 0

    def _cut_tokens(self, trainer, step: int) -> np.ndarray:
        """Tokens of each source a context warmup cut in steps ``[0, step)``: brought up to
        date on logged steps only, from the data's pure order (so also after a resume)."""
        full = trainer.plan.seq_len
        while self._cut_to < step and trainer.sequence_length(self._cut_to) < full:
            cut = full - trainer.sequence_length(self._cut_to)
            self._cut += cut * trainer.dataset.step_counts(self._cut_to, trainer.plan.global_batch)
            self._cut_to += 1
        return self._cut

    def on_step_end(self, trainer, result) -> None:
        step = trainer.progress.step
        if not self.names or (step % trainer.recipe.run.log_interval
                              and step not in (1, trainer.total_steps)):
            return
        counts = trainer.train_loader.source_counts()
        new = {n: counts[n] - self._before.get(n, 0) for n in self.names}
        total = sum(new.values()) or 1
        values: dict[str, float] = {}
        cut = self._cut_tokens(trainer, step)
        for i, n in enumerate(self.names):
            values[f"data/tokens/{n}"] = counts[n] * trainer.plan.seq_len - int(cut[i])
            values[f"data/share/{n}"] = new[n] / total
        # the first step of the stage this step trained in: `kiln plot` marks the switches
        values["data/stage_start"] = trainer.dataset.stage_of(step - 1).step
        losses = trainer.step_context.source_losses
        if losses is not None:
            sums = distributed.all_reduce_(losses.take())  # every rank logs on the same steps
            for n, (s, c) in zip(self.names, sums.tolist(), strict=True):
                if c > 0:
                    values[f"train/loss/{n}"] = s / c
        trainer.metrics.log(step, values)
        self._before = counts
        if trainer.world.is_main:
            parts = [f"{n} {values[f'train/loss/{n}']:.4f}" if f"train/loss/{n}" in values
                     else f"{n} -" for n in self.names]  # "-": no token of it since the last
            shares = "/".join(f"{values[f'data/share/{n}']:.0%}" for n in self.names)
            trainer.print(f"      sources: {'  '.join(parts)}  (shares {shares})")

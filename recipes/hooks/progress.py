"""The progress bar on a terminal."""

from __future__ import annotations

import sys

from kiln.components.protocols import Hook


class ProgressHook(Hook):
    """A tqdm bar on the main rank: steps, loss, tokens/s, ETA. Only on a terminal: in a file or
    a pipe its redraws would be carriage-return frames in the log, where the log lines every
    ``run.log_interval`` steps already show the progress."""

    priority = 20

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

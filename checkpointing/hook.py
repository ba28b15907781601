"""The trainer's checkpointing hook: resume at start, interval and preemption saves, final save.

Policy (the ``[checkpoint]`` table): save every ``interval`` steps and at the end, keep the newest
``keep_last`` snapshots plus ``final``; resume per ``resume``; on SIGTERM/SIGINT save at the next
step boundary and stop (the trainer then returns normally, so the process exits 0).

The hook sits below the trainer: what needs the recipes package (diffing the checkpoint's recipe
against the current one, exporting a checkpoint) is passed in by the trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.checkpointing import resume
from kiln.checkpointing.manager import CheckpointManager
from kiln.checkpointing.preemption import Preemption
from kiln.components import distributed


def checkpoint_root(recipe) -> Path:
    folder = Path(recipe.checkpoint.folder)
    return folder if folder.is_absolute() else Path(recipe.run.folder) / folder


class CheckpointHook:
    """A trainer hook (``on_train_start``, ``on_step_end``, ``on_train_end``, ``close``).

    ``recipe_diff(folder)`` diffs a checkpoint's recipe against the run's (resume check);
    ``export(out_dir)`` writes the trainer's model as an export (called on every rank: each
    writes its share), for ``export_at_end`` and the Hub upload of the final model."""

    def __init__(self, trainer, *, recipe_diff: Callable[[Path], Any],
                 export: Callable[[Path], Any] | None = None, hub_api=None) -> None:
        self.recipe_diff = recipe_diff
        self.export = export
        self.cfg = cfg = trainer.recipe.checkpoint
        self.root = checkpoint_root(trainer.recipe)
        self.hub = None
        if cfg.hub_repo and trainer.world.is_main:
            from kiln.checkpointing.hub import HubSync

            self.hub = HubSync(cfg.hub_repo, keep=cfg.hub_keep, private=cfg.hub_private,
                               api=hub_api, token_env=cfg.hub_token_env, log=trainer.print)
        upload = self.hub is not None and cfg.hub_upload in ("checkpoints", "both")
        self.manager = CheckpointManager(
            self.root, trainer.world, keep_last=cfg.keep_last, async_save=cfg.async_save,
            on_publish=self.hub.upload_checkpoint if upload else None, log=trainer.print,
        )
        self.preemption = Preemption(log=trainer.print) if cfg.preemption else None
        self.resumed_from: Path | None = None
        self._hub_api = hub_api
        self._last_loss: float | None = None

    # --------------------------------------------------------------------------------- start
    def on_train_start(self, trainer) -> None:
        if self.preemption is not None:
            self.preemption.install()
        cfg = self.cfg
        source = self._resolve(trainer)
        if source is None:
            return
        weights_only = cfg.weights_only and source.explicit
        if source.note:
            trainer.print(f"kiln: {source.note}")
        resume.compare_with_checkpoint(source.folder, self.recipe_diff,
                                       weights_only=weights_only, log=trainer.print)
        distributed.barrier()  # every rank has resolved the source before any folder moves
        if source.explicit and not weights_only and trainer.world.is_main:
            moved = resume.abandon_newer(self.root, source.folder)
            if moved:
                trainer.print(f"kiln: rolling back: moved newer checkpoints {', '.join(moved)} to "
                              f"{self.root / 'abandoned'}")
        distributed.barrier()
        loaded = self.manager.load(trainer, source.folder, weights_only=weights_only,
                                   from_ema=cfg.from_ema and weights_only)
        self.resumed_from = source.folder
        if weights_only:
            trainer.print(f"kiln: started from the weights of {source.folder} (step "
                          f"{loaded.step}{', EMA' if cfg.from_ema else ''}); fresh optimizer, "
                          "schedule, data and guard history")
        else:
            self.manager.last_saved_step = loaded.step
            trainer.print(f"kiln: resumed from {source.folder} at step {loaded.step}")
        if source.explicit and cfg.skip_data_steps:
            trainer.train_loader.skip_steps(cfg.skip_data_steps)
            trainer.print(f"kiln: skipped {cfg.skip_data_steps} steps of data")

    def _resolve(self, trainer) -> resume.Source | None:
        download = None
        if self.cfg.resume.startswith("hf://"):
            from kiln.checkpointing import hub

            def download(spec: str) -> Path:
                # Rank 0 fetches first; the others then find the files in the shared cache.
                if trainer.world.is_main:
                    path = hub.download(spec, api=self._hub_api, token_env=self.cfg.hub_token_env)
                distributed.barrier()
                if not trainer.world.is_main:
                    path = hub.download(spec, api=self._hub_api, token_env=self.cfg.hub_token_env)
                return path

        return resume.resolve(self.cfg.resume, self.root, download=download)

    # ---------------------------------------------------------------------------------- steps
    def on_step_end(self, trainer, result) -> None:
        step = trainer.progress.step
        self._last_loss = result.loss
        stop = self.preemption is not None and self.preemption.requested(trainer.device)
        due = self.cfg.interval and step % self.cfg.interval == 0 and step < trainer.total_steps
        if due or stop:
            self.manager.save(trainer, extra={"loss": result.loss})
        if stop:
            self.manager.wait()
            trainer.stop_requested = True
            trainer.print(f"kiln: stopped at step {step} on a signal; the checkpoint is saved. "
                          "Rerun the same command to continue.")

    # ------------------------------------------------------------------------------------ end
    def on_train_end(self, trainer) -> None:
        step = trainer.progress.step
        if step >= trainer.total_steps and not trainer.stop_requested:
            if self.manager.last_saved_step != step:
                self.manager.save(trainer, extra={"loss": self._last_loss})
            self.manager.mark_final(step)
            upload = bool(self.cfg.hub_repo) and self.cfg.hub_upload in ("export", "both")
            if (self.cfg.export_at_end or upload) and self.export is not None:
                out = Path(trainer.run_dir) / "export"
                self.export(out)
                trainer.print(f"kiln: exported the final model to {out}")
                if upload and self.hub is not None:
                    self.hub.upload_export(out)

    def close(self, trainer) -> None:
        """Also after an exception (e.g. a guard abort): finish an in-flight async save of an
        earlier, good step, then restore the signal handlers."""
        try:
            self.manager.wait()
            if self.hub is not None:
                self.hub.wait()
        finally:
            if self.preemption is not None:
                self.preemption.uninstall()

"""The trainer's checkpointing hook: resume at start, interval and preemption saves, final save.

Policy (the ``[checkpoint]`` table): save every ``interval`` steps, every ``interval_minutes``
and at the end, keep the newest ``keep_last`` snapshots plus ``final``; resume per ``resume``; on
SIGTERM/SIGINT, or when ``training.max_hours`` is nearly spent (``clock.py``), save at the next
step boundary and stop (the trainer then returns normally, so the process exits 0 and the same
command continues the run).

Unattended recovery: when the run's own newest snapshot fails verification (any damage: a
hash mismatch, a truncated or missing file, no manifest), the hook moves it to
``checkpoints/corrupt/``, warns (console, metrics, ``RECOVERED.json`` in the run folder) and takes
the next newest; ``strict_resume`` stops instead. A run folder with snapshots but none usable
stops with an error listing them and the flags that start over on purpose: it is never
silently trained again from step 1.

The hook sits below the trainer: what needs the recipes package (diffing the checkpoint's recipe
against the current one, exporting a checkpoint) is passed in by the trainer.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.checkpointing import layout, resume
from kiln.checkpointing.manager import CheckpointManager
from kiln.checkpointing.unattended.clock import WallClock, agree, estimate_save_s
from kiln.checkpointing.unattended.preemption import Preemption
from kiln.components import distributed
from kiln.components.errors import CheckpointError
from kiln.components.protocols import Hook

RECOVERED = "RECOVERED.json"  # in the run folder: every unattended recovery, appended


def checkpoint_root(recipe) -> Path:
    folder = Path(recipe.checkpoint.folder)
    return folder if folder.is_absolute() else Path(recipe.run.folder) / folder


class CheckpointHook(Hook):
    """A trainer hook (``on_train_start``, ``on_step_end``, ``on_train_end``, ``close``).

    ``recipe_diff(folder)`` diffs a checkpoint's recipe against the run's (resume check);
    ``export(out_dir)`` writes the trainer's model as an export (called on every rank: each
    writes its share), for ``export_at_end`` and the Hub upload of the final model;
    ``keep(root)`` names the snapshots rotation must spare (a pending evaluation's)."""

    priority = 10  # after the hooks that log a step: its metrics are written first

    def __init__(self, trainer, *, recipe_diff: Callable[[Path], Any],
                 export: Callable[[Path], Any] | None = None, hub_api=None,
                 keep: Callable[[Path], set[str]] | None = None) -> None:
        self.recipe_diff = recipe_diff
        self.export = export
        self.cfg = cfg = trainer.recipe.checkpoint
        self.root = checkpoint_root(trainer.recipe)
        self.hub = None
        if cfg.hub_repo and trainer.world.is_main:
            from kiln.checkpointing.huggingface.hub import HubSync

            self.hub = HubSync(cfg.hub_repo, keep=cfg.hub_keep, private=cfg.hub_private,
                               api=hub_api, token_env=cfg.hub_token_env, log=trainer.print)
        upload = self.hub is not None and cfg.hub_upload in ("checkpoints", "both")
        self.manager = CheckpointManager(
            self.root, trainer.world, keep_last=cfg.keep_last, async_save=cfg.async_save,
            on_publish=self.hub.upload_checkpoint if upload else None, log=trainer.print,
            on_error=cfg.on_save_error, keep=(lambda: keep(self.root)) if keep else None,
        )
        self.preemption = Preemption(log=trainer.print) if cfg.preemption else None
        self.clock = WallClock(trainer.recipe.training.max_hours, cfg.interval_minutes)
        self._resumed = False
        self._load_s: float | None = None  # the resume's load: a save's duration until one ran
        self.resumed_from: Path | None = None
        self._hub_api = hub_api
        self._last_loss: float | None = None

    # --------------------------------------------------------------------------------- start
    def resume(self, trainer) -> None:
        """Continue from the newest usable snapshot; the trainer calls it before any hook
        starts. Once: ``on_train_start`` resumes a trainer that did not call it."""
        if not self._resumed:
            self._resumed = True
            self._resume(trainer)

    def on_train_start(self, trainer) -> None:
        if self.preemption is not None:
            self.preemption.install()
        self.resume(trainer)
        self.clock.begin()  # steps are timed from here, the resume's load not included

    def _resume(self, trainer) -> None:
        cfg = self.cfg
        if cfg.resume == "off":
            self._start_over(trainer)
        valid, tried = (None, []) if cfg.resume == "off" else self._set_aside_damaged(trainer)
        source = self._resolve(trainer)
        if tried:
            self._report_recovery(trainer, source, tried)
        if source is None:
            if cfg.resume == "auto":
                layout.check_no_stray_snapshots(Path(trainer.run_dir), self.root,
                                                f"checkpoint.folder = {cfg.folder!r}")
            return
        verified = valid is not None and source.folder.resolve() == valid.resolve()
        weights_only = cfg.weights_only and source.explicit
        if source.note:
            trainer.print(f"kiln: {source.note}")
        resume.compare_with_checkpoint(source.folder, self.recipe_diff,
                                       weights_only=weights_only, log=trainer.print,
                                       data_record=getattr(trainer, "data_record", None))
        if not weights_only:  # a new schedule may start on other data
            dataset = getattr(trainer, "dataset", None)  # (a test's train state has none)
            for line in resume.check_data(
                    source.folder, getattr(trainer, "data_record", None),
                    policy=cfg.on_data_change, total_steps=trainer.total_steps,
                    pin=dataset.pin_stages if dataset is not None else None):
                trainer.print(line)
        distributed.barrier()  # every rank has resolved the source before any folder moves
        if source.explicit and not weights_only and trainer.world.is_main:
            moved = resume.abandon_newer(self.root, source.folder)
            if moved:
                trainer.print(f"kiln: rolling back: moved newer checkpoints {', '.join(moved)} to "
                              f"{self.root / 'abandoned'}")
        distributed.barrier()
        started = time.monotonic()
        loaded = self.manager.load(trainer, source.folder, weights_only=weights_only,
                                   from_ema=cfg.from_ema and weights_only,
                                   keep_optimizer=cfg.keep_optimizer and weights_only,
                                   verified=verified)
        self._load_s = time.monotonic() - started
        self.resumed_from = source.folder
        if weights_only:
            trainer.parent = resume.parent_record(source.folder, "weights_only")
            fresh = ("kept optimizer state; fresh" if cfg.keep_optimizer
                     else "fresh optimizer,")
            trainer.print(f"kiln: started from the weights of {source.folder} (step "
                          f"{loaded.step}{', EMA' if cfg.from_ema else ''}); {fresh} schedule, "
                          "data and guard history")
        else:
            self.manager.last_saved_step = loaded.step
            trainer.print(f"kiln: resumed from {source.folder} at step {loaded.step}")
            if loaded.mapping:
                trainer.print("kiln: resumed on a different layout:\n  "
                              + "\n  ".join(loaded.mapping))
        if source.explicit and cfg.skip_data_steps:
            trainer.train_loader.skip_steps(cfg.skip_data_steps)
            trainer.print(f"kiln: skipped {cfg.skip_data_steps} steps of data")

    def _start_over(self, trainer) -> None:
        """``resume = "off"`` where this run folder already holds snapshots: they move to
        ``checkpoints/previous/N/``, said in one line, before the new run's first save."""
        moved, dest = resume.set_aside_previous(self.root) if trainer.world.is_main else ([], None)
        if trainer.world.distributed:
            moved, dest = distributed.broadcast_object((moved, dest))
        if moved:
            trainer.print(f'kiln: checkpoint.resume = "off": this run folder\'s snapshots '
                          f"{', '.join(moved)} moved to {dest} (kept); training starts from "
                          "step 1")
        distributed.barrier()

    def _set_aside_damaged(self, trainer) -> tuple[Path | None, list[dict[str, str]]]:
        """Unattended recovery over the run's own snapshots, newest first: every one that fails
        verification (a flipped byte, a truncated or deleted file, no manifest, an unreadable
        state.json: all damage alike) moves to ``checkpoints/corrupt/`` until one verifies
        (``strict_resume``: stop instead). Returns (the valid one or None, what was moved).

        A ``step_*`` folder appears only by renaming a sealed save into place, so one without its
        manifest is damage, never a save in progress (those are ``.tmp-*``). A run folder that
        holds snapshots but none usable is never started over silently: CheckpointError."""
        names = [p.name for _, p in layout.list_checkpoints(self.root)]
        if trainer.world.distributed:  # every rank walks the same list (rank 0's)
            names = distributed.broadcast_object(names)
        tried: list[dict[str, str]] = []
        for name in reversed(names):
            folder = self.root / name
            error = self.manager.verify(folder)
            if error is None:
                return folder, tried
            if self.cfg.strict_resume:
                raise CheckpointError(
                    f"{error}\ncheckpoint.strict_resume = true, so kiln stops instead of moving "
                    f"it to {self.root / resume.CORRUPT} and resuming from an older snapshot; "
                    "set strict_resume = false to recover automatically, or point "
                    "checkpoint.resume at the snapshot to use"
                )
            moved = resume.quarantine(self.root, folder) if trainer.world.is_main else None
            tried.append({"checkpoint": name, "error": error,
                          "moved_to": str(distributed.broadcast_object(moved)
                                          if trainer.world.distributed else moved)})
            trainer.print(f"kiln: WARNING: checkpoint {name} is corrupt: {error}\n"
                          f"kiln: WARNING: moved it to {tried[-1]['moved_to']}")
            distributed.barrier()  # every rank sees the moved folder before going on
        earlier = sorted(set(resume.quarantined(self.root)) - {t["moved_to"] for t in tried})
        if tried or earlier:
            if tried:
                self._record(trainer, None, tried)
            raise CheckpointError(self._none_usable(tried, earlier))
        return None, tried

    def _none_usable(self, tried: list[dict[str, str]], earlier: list[str]) -> str:
        lines = [f"{t['checkpoint']}: {t['error']} (moved to {t['moved_to']})" for t in tried]
        lines += [f"{path} (set aside by an earlier start)" for path in earlier]
        return (
            f"{self.root}: this run has snapshots but none is usable, so kiln does not start it "
            "over; found (newest first):\n  " + "\n  ".join(lines)
            + f"\nThey are kept in {self.root / resume.CORRUPT} for inspection (what went wrong: "
            f"{RECOVERED} in the run folder). To start over on purpose: "
            "--checkpoint.resume=off trains this run folder from step 1 (once: rerun without it "
            "afterwards so a later restart continues the new snapshots; metrics.jsonl is appended "
            "to), or --run.folder=NEW_FOLDER starts a new run beside this one."
        )

    def _report_recovery(self, trainer, source: resume.Source | None, tried: list[dict]) -> None:
        """Loud: console, metrics and RECOVERED.json in the run folder (appended per event)."""
        name = source.folder.name if source is not None else None
        step = layout.step_of(name) if name else None
        trainer.print(
            f"kiln: WARNING: RECOVERED from {len(tried)} corrupt snapshot(s): resuming from "
            f"{name} (step {step}), the newest valid one. Details: "
            f"{Path(trainer.run_dir) / RECOVERED}; checkpoint.strict_resume = true stops "
            "instead."
        )
        if trainer.world.is_main:
            trainer.metrics.log(step or 0, {"checkpoint/recovered": 1.0,
                                            "checkpoint/corrupt_snapshots": float(len(tried))})
        self._record(trainer, name, tried)

    def _record(self, trainer, resumed_from: str | None, tried: list[dict]) -> None:
        """Append one recovery event to RECOVERED.json in the run folder (rank 0)."""
        if not trainer.world.is_main:
            return
        path = Path(trainer.run_dir) / RECOVERED
        events = []
        if path.is_file():
            try:
                events = json.loads(path.read_text(encoding="utf-8")).get("events", [])
            except (ValueError, AttributeError):
                events = []  # an unreadable record is replaced, not fatal
        events.append({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed_from": resumed_from,
                       "step": layout.step_of(resumed_from) if resumed_from else None,
                       "corrupt": tried})
        path.parent.mkdir(parents=True, exist_ok=True)
        layout.write_json(path, {"events": events})

    def _resolve(self, trainer) -> resume.Source | None:
        download = None
        if self.cfg.resume.startswith("hf://"):
            from kiln.checkpointing.huggingface import hub

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
        step, total = trainer.progress.step, trainer.total_steps
        self._last_loss = result.loss
        self.clock.step_done()
        signal, time_save, out_of_time = self._decide(trainer, step < total)
        due = self.cfg.interval and step % self.cfg.interval == 0 and step < total
        if (due or time_save or signal or out_of_time) and self.manager.last_saved_step != step:
            trainer.metrics.flush()  # the step's line (written by the hooks before this one)
            started = time.monotonic()
            self.manager.save(trainer, extra={"loss": result.loss}, final=signal or out_of_time)
            if signal or out_of_time:
                self.manager.wait(final=True)
            self.clock.saved(time.monotonic() - started)
        if signal or out_of_time:
            trainer.stop_requested = True
            trainer.print(self._stop_message(trainer, "a signal" if signal else "the budget"))

    def _decide(self, trainer, more: bool) -> tuple[bool, bool, bool]:
        """(signal, time-based save due, out of time), the same on every rank: a signal on any
        rank counts; the clock's decisions are rank 0's. One all-reduce for all three."""
        signal = self.preemption is not None and self.preemption.signum is not None
        if self.preemption is None and not self.clock.active:
            return False, False, False
        main = trainer.world.is_main and more
        time_save = main and self.clock.save_due()
        out_of_time = main and self.clock.out_of_time(self.save_estimate(trainer))
        signal, time_save, out_of_time = agree([signal, time_save, out_of_time], trainer.device)
        return signal, time_save, out_of_time

    def save_estimate(self, trainer) -> float:
        """Seconds one save takes: the last one's, else the resume's load, else a guess."""
        for seconds in (self.manager.last_save_s, self._load_s):
            if seconds is not None:
                return seconds
        return estimate_save_s(trainer.model)

    def _stop_message(self, trainer, why: str) -> str:
        step, total = trainer.progress.step, trainer.total_steps
        if why == "a signal":
            return (f"kiln: stopped at step {step} on a signal; the checkpoint is saved. "
                    "Rerun the same command to continue.")
        hours = trainer.recipe.training.max_hours
        return (f"kiln: stopped at step {step} of {total} ({step / total:.1%}) after "
                f"{self.clock.elapsed():.1f} s: training.max_hours = {hours:g} "
                f"({self.clock.budget_s:.0f} s) would end before another step and its save "
                f"(~{self.clock.margin(self.save_estimate(trainer)):.1f} s); the checkpoint is "
                "saved. Rerun the same command to continue.")

    # ------------------------------------------------------------------------------------ end
    def on_train_end(self, trainer) -> None:
        step = trainer.progress.step
        self.manager.wait()  # an async save still in flight reports its outcome now
        if step >= trainer.total_steps and not trainer.stop_requested:
            if self.manager.last_saved_step != step:
                trainer.metrics.flush()
                self.manager.save(trainer, extra={"loss": self._last_loss}, final=True)
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
            self.manager.wait(agree=False)  # no collective: other ranks may have failed
            if self.hub is not None:
                self.hub.wait()
        finally:
            if self.preemption is not None:
                self.preemption.uninstall()

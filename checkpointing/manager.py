"""Save and load a run's complete state through DCP, atomically, optionally in the background.

The manager works on a *train state*: any object with ``model``, ``optimizers`` (an
``OptimizerSet`` or a dict name -> optimizer), ``progress`` (``state_dict``/``load_state_dict``),
``guards`` (dict), ``world`` (``kiln.components.distributed.World``) and optionally
``recipe_toml`` (the resolved recipe's text, copied into every snapshot), ``data_record`` (a
JSON dict: the data's fingerprints and stage steps, checked on resume), ``base_record`` (an
adapters-only run's base: init_from and its weights' fingerprint), ``frozen_record`` (the
same of each frozen model a step read from a source, by source), ``train_loader``
(``state_dict``/``load_state_dict``) and ``layout`` (a JSON dict: ``world_size``, ``mesh``,
``fsdp``, ``global_batch``, ``micro_batch``, ``grad_accum`` and this rank's global-batch
``rows``). The trainer is one; tests use small ones.

Model and optimizers go through ``app_state`` (DCP's ``get_state_dict``/``set_state_dict``), so
plain and FSDP2-sharded models share one path (DCP reshards tensors across layouts). Everything
per-rank (RNG, the model's carry, the loader cursor) goes into the rank's safetensors file; on the
same layout each rank reads its own file back, on another layout ``remap`` assembles it by global
batch row.
"""

from __future__ import annotations

import contextlib
import gc
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from kiln.checkpointing import (
    app_state,
    layout,
    payload,
    rank_json,
    remap,
    rng,
    storage,
)
from kiln.checkpointing.load_checks import (
    QKV_ROWS,
    STATE,
    Loaded,
    check_payload_fits,
    check_qkv_rows,
    check_rank_state,
    device_of,
    rank_file,
    read_state,
)
from kiln.checkpointing.unattended import save_failure
from kiln.checkpointing.unattended.save_failure import SAVE_ERRORS, SaveFailed
from kiln.components import distributed
from kiln.components.errors import CheckpointError, DataError

RECIPE = "recipe.toml"


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Python's automatic garbage collection off for the block. Reading DCP's index and the
    JSON state makes many small objects, and when that tips a full collection, the collector
    walks every object of a training process (about 300k on a small CPU run): 170-200 ms
    pauses inside a 100 ms load of the 74 MB benchmark state (docs/benchmarks.md). The objects
    are collected at the next automatic collection after the block."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class CheckpointManager:
    def __init__(self, root: Path, world, *, keep_last: int = 3, async_save: bool = False,
                 on_publish: Callable[[Path], None] | None = None, log=print,
                 on_error: str = "stop", keep: Callable[[], Iterable[str]] | None = None) -> None:
        self.root = Path(root)
        self.keep = keep  # names of snapshots rotation must spare (a pending evaluation's)
        self.world = world
        self.keep_last = keep_last
        self.async_save = async_save
        self.on_publish = on_publish
        self.log = log
        self.on_error = on_error  # a failed save: "stop" (CheckpointError) or "continue"
        self._pending: dict[str, Any] | None = None  # the one save in flight
        self._purging: threading.Thread | None = None  # deletes rotated-out checkpoints
        self._async_failure: tuple[int, str] | None = None  # (step, reason), rank 0's thread
        self.last_saved_step: int | None = None
        self.last_save_s: float | None = None  # how long the last save took to write, in full
        # Background saves need their own process group: DCP's collectives then never
        # interleave with the training loop's on the default group.
        self._pg = dist.new_group(backend="gloo") if async_save and world.distributed else None

    # ------------------------------------------------------------------------------- saving
    @_gc_paused()
    def save(self, state, *, extra: dict[str, Any] | None = None,
             final: bool = False) -> Path | None:
        """Save the state at its current step; returns the folder it will be published as.

        A failed save (a full disk, an I/O error, on any rank) removes its partial folder and
        raises one CheckpointError naming the step, the cause and the intact previous
        checkpoint; with ``on_error = "continue"`` it logs that instead and returns None, unless
        ``final`` (the last save of the run, or the one before a preemption stop)."""
        self.wait()
        started = time.monotonic()
        step = int(state.progress.step)
        name = layout.step_name(step)
        tmp = self.root / f"{layout.TMP_PREFIX}{name}"
        try:
            self._together(lambda: self._prepare(tmp))
            # Every rank gathers the JSON state first: a collective inside a part that can fail
            # on one rank would leave the others waiting in it.
            tensors, rest = storage.split_tree(app_state.collect(state, with_optim=True))
            rest = rank_json.merge(distributed.all_gather_object(rest))  # pipeline stages differ
            seal = self._together(lambda: self._write_small(state, tmp, step, extra, rest))
            writer = FileSystemWriter(str(tmp), sync_files=True)
            storage.quiet_dcp()
            if self.async_save:
                future = self._together(lambda: dcp.async_save(
                    tensors, storage_writer=writer, process_group=self._pg,
                    no_dist=not self.world.distributed))
                future.add_done_callback(
                    lambda f: setattr(self, "last_save_s", time.monotonic() - started))
                pending: dict[str, Any] = {"future": future, "step": step}
                if self.world.is_main:
                    thread = threading.Thread(target=self._finish_async,
                                              args=(tmp, step, seal, future),
                                              name="kiln-checkpoint", daemon=True)
                    thread.start()
                    pending["thread"] = thread
                self._pending = pending
            else:
                self._together(lambda: dcp.save(tensors, storage_writer=writer,
                                                no_dist=not self.world.distributed))
                self._together(lambda: self._publish(tmp, step, seal) if self.world.is_main
                               else None)
                if self.world.is_main and self.on_publish is not None:
                    self.on_publish(self.root / name)  # after the save: not a save failure
                self.last_save_s = time.monotonic() - started
        except SaveFailed as failed:
            return self._failed(step, tmp, failed.reason, final=final)
        self.last_saved_step = step
        return self.root / name

    def _prepare(self, tmp: Path) -> None:
        if self.world.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            layout.remove_temporaries(self.root)
            tmp.mkdir()

    def _write_small(self, state, tmp: Path, step: int, extra: dict[str, Any] | None,
                     rest: dict[str, Any]) -> dict[str, Any]:
        """This rank's file (RNG, carry, payload, loader cursor: captured at this step) and, on
        rank 0, state.json (with ``rest``, the model and optimizer state that is not tensors) and
        recipe.toml. Returns the manifest's extra fields."""
        rng_tensors, rng_info = rng.capture()
        pay = payload.capture(step, state.model, state.guards)
        carry_tensors, pay_header = payload.split(pay)
        loader = getattr(state, "train_loader", None)
        state_layout = getattr(state, "layout", None)
        header = {
            "rank": self.world.rank, "world_size": self.world.world_size, "rng": rng_info,
            "payload": pay_header,
            "loader": storage.to_json(loader.state_dict(), "loader") if loader is not None
            and hasattr(loader, "state_dict") else None,
            "batch": remap.batch_header(state_layout),
        }
        storage.save_rank_file(rank_file(tmp, self.world.rank), {**rng_tensors, **carry_tensors},
                               header)
        meta = {
            "format": layout.FORMAT, "step": step, "tokens": int(state.progress.tokens),
            "world_size": self.world.world_size, "progress": state.progress.state_dict(),
            "optimizers": sorted(app_state.optimizers_of(state)), "json_state": rest,
            "layout": storage.to_json({k: v for k, v in (state_layout or {}).items()
                                       if k != "rows"}, "layout"),
            "qkv_rows": QKV_ROWS,
        }
        # what the cursor points into; an adapters-only base; a step's frozen models' sources
        for key in ("data", "base", "frozen"):
            if (record := getattr(state, f"{key}_record", None)) is not None:
                meta[key] = storage.to_json(record, key)  # (checked on resume: resume.py)
        seal = {"tokens": int(state.progress.tokens), "world_size": self.world.world_size,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                # JSON has no NaN: a non-finite loss (a step a guard skipped) is kept as text
                **{k: str(v) if isinstance(v, float) and not math.isfinite(v) else v
                   for k, v in (extra or {}).items()}}
        if self.world.is_main:  # plain writes: the folder is published whole, once sealed
            (tmp / STATE).write_text(layout.json_text(meta), encoding="utf-8")
            recipe_toml = getattr(state, "recipe_toml", None)
            if recipe_toml is not None:
                (tmp / RECIPE).write_text(recipe_toml, encoding="utf-8")
        return seal

    def _together(self, part: Callable[[], Any]) -> Any:
        return save_failure.together(self.world, self.root, part)

    def _failed(self, step: int, tmp: Path, reason: str, *, final: bool,
                logged: bool = False) -> None:
        """After a failed save: remove its partial folder, then stop or go on per on_error."""
        if self.world.is_main:
            save_failure.discard(tmp)
        text = save_failure.message(step, reason, self.root)
        if self.on_error == "continue" and not final:
            if not logged:
                self.log(f"kiln: {text}")
            self.log('kiln: training goes on (checkpoint.on_save_error = "continue"); the next '
                     "save tries again")
            return None
        fix = ("Free space there (or lower checkpoint.keep_last, or point checkpoint.folder "
               "elsewhere) and rerun" if save_failure.FULL_DISK in reason else
               "Remove the cause above (an error of the file system, or of what the state "
               "holds) and rerun")
        raise CheckpointError(
            f"{text}.\n{fix} the same command: it continues from the intact checkpoint. "
            "checkpoint.on_save_error = \"continue\" keeps training when an interval save "
            "fails instead."
        )

    def wait(self, *, final: bool = False, agree: bool = True) -> None:
        """Block until the save in flight (if any) is published or has failed; a failure is
        handled as in ``save`` (every rank takes rank 0's verdict; ``agree=False``, after an
        error elsewhere: no collective, rank 0 only reports it)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending["future"].exception()  # this rank's share written (or failed: rank 0 knows)
            if "thread" in pending:
                pending["thread"].join()
        if self._purging is not None:  # after the publish above, which may have started it
            self._purging.join()
            self._purging = None
        if pending is None:
            return
        failure, self._async_failure = self._async_failure, None
        if agree and self.world.distributed:
            failure = distributed.broadcast_object(failure)
        if failure is None:
            return
        if not agree:  # rank 0's thread has printed the failure line; nothing more to do
            return
        step, reason = failure
        tmp = self.root / f"{layout.TMP_PREFIX}{layout.step_name(step)}"
        self._failed(step, tmp, reason, final=final, logged=True)

    def _finish_async(self, tmp: Path, step: int, seal: dict[str, Any], future) -> None:
        """Rank 0's thread: wait for DCP (its collectives make every rank's failure rank 0's
        too), then publish; a failure is printed at once and acted on at the next ``wait``."""
        exc = future.exception()
        reason = save_failure.describe(exc, self.root) if exc is not None else None
        if reason is None:
            try:
                self._publish(tmp, step, seal)
            except SAVE_ERRORS as publish_exc:
                reason = save_failure.describe(publish_exc, self.root)
            else:
                if self.on_publish is not None:  # starts an upload thread (HubSync)
                    self.on_publish(self.root / layout.step_name(step))
                return
        save_failure.discard(tmp)
        self._async_failure = (step, reason)
        self.log(f"kiln: {save_failure.message(step, reason, self.root)}")

    def _publish(self, tmp: Path, step: int, seal: dict[str, Any]) -> None:
        """Rank 0: seal, rename into place (the save is then done), point ``latest`` at it,
        rotate, index."""
        name = layout.step_name(step)
        layout.write_manifest(tmp, step, seal)
        layout.publish(tmp, self.root / name)
        try:
            layout.write_atomic(self.root / "latest", name + "\n", durable=False)
            removed = layout.rotate(self.root, self.keep_last,
                                    self.keep() if self.keep is not None else ())
            layout.write_index(self.root)
            if removed:  # deleting their files is slow; the next save (or the end) waits
                self._purging = threading.Thread(target=layout.purge, args=(self.root,),
                                                 name="kiln-checkpoint-purge", daemon=True)
                self._purging.start()
        except OSError as exc:  # the snapshot is complete; these only help humans and tools
            self.log(f"kiln: WARNING: checkpoint step {step} is saved, but updating latest / "
                     f"rotating / index.json failed ({exc}); a resume finds it anyway")
            removed = []
        self.log(f"kiln: checkpoint step {step} -> {self.root / name}"
                 + (f" (rotated out {', '.join(removed)})" if removed else ""))

    def mark_final(self, step: int) -> None:
        """Point ``final`` at the checkpoint of ``step`` (rank 0; after ``wait``)."""
        self.wait(final=True)
        if self.world.is_main:
            layout.set_link(self.root, "final", layout.step_name(step))
            layout.write_index(self.root)
        distributed.barrier()

    # ------------------------------------------------------------------------------ loading
    @_gc_paused()
    def load(self, state, folder: Path, *, weights_only: bool = False,
             from_ema: bool = False, keep_optimizer: bool = False,
             verified: bool = False) -> Loaded:
        """Restore ``state`` from a checkpoint folder; validates before changing anything.
        ``verified``: the caller has just checked the folder's hashes (``verify``);
        ``keep_optimizer``: a weights-only load keeps the optimizer state it read."""
        folder = Path(folder)
        if not verified:
            error = self.verify(folder)
            if error is not None:
                raise CheckpointError(error)
        meta = read_state(folder)
        check_qkv_rows(folder, meta, state.model)
        saved_ws = meta["world_size"]
        step = int(meta["step"])
        ranked, mapping = None, []
        if not weights_only:
            ranked, mapping = self._rank_state(folder, meta, state)

        with_optim = not weights_only or from_ema or keep_optimizer
        current = app_state.collect(state, with_optim=with_optim)
        tensors, current_rest = storage.split_tree(current)
        storage.load_tensors(
            tensors, folder, no_dist=not self.world.distributed,
            hint=" -- the saved tensors do not fit this model/optimizer; did the model or "
            "optimizer change? `kiln diff` the checkpoint against the recipe")
        app_state.apply(state, tensors, meta["json_state"], with_optim, folder, current,
                        current_rest.get("model", {}))

        if weights_only:
            optimizers = app_state.optimizers_of(state)
            if from_ema:
                swapped = [n for n, o in optimizers.items() if hasattr(o, "swap_ema")]
                if not swapped:
                    raise CheckpointError(
                        "checkpoint.from_ema = true, but none of the optimizers "
                        f"({', '.join(optimizers)}) keeps EMA weights (swap_ema)"
                    )
                for name in swapped:
                    optimizers[name].swap_ema()
            if not keep_optimizer:
                for opt in optimizers.values():
                    opt.state.clear()  # fresh moments: a new run that starts from these weights
            return Loaded(folder, step, True, saved_ws)

        rng_tensors, rng_info, pay, loader_state = ranked
        state.progress.load_state_dict(meta["progress"])
        for name, guard in state.guards.items():
            guard.load_state_dict(pay["guard_fields"][name])
        if pay["carry"] is not None:
            state.model.load_carry_state(
                {k: v.to(device_of(state.model)) for k, v in pay["carry"].items()})
        loader = getattr(state, "train_loader", None)
        if loader is not None and loader_state is not None:
            try:  # checked before any tensor was read (check_payload_fits); a loader without
                loader.load_state_dict(loader_state)  # check_state_dict fails here at worst
            except (DataError, KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{folder}: data loader cursor: {type(exc).__name__}: "
                                      f"{exc}") from None
        if rng_tensors is not None:  # same layout: each rank's generators exactly as saved
            rng.restore(rng_tensors, rng_info, where=str(folder))
        return Loaded(folder, step, False, saved_ws, mapping)

    def _rank_state(self, folder: Path, meta: dict, state) -> tuple[tuple, list[str]]:
        """(rng tensors, rng info, payload, loader cursor) of this rank, and how it was mapped
        (empty on the same layout: the rank's own file, exactly)."""
        step, saved_ws = int(meta["step"]), meta["world_size"]
        layout_now = getattr(state, "layout", None)
        target = remap.rows_of(layout_now)
        notes = remap.describe_change(meta.get("layout"), layout_now)
        if saved_ws == self.world.world_size:
            tensors, header = storage.load_rank_file(rank_file(folder, self.world.rank))
            remap.check_header(header, str(rank_file(folder, self.world.rank)))
            if remap.rows_of(header.get("batch")) == target:  # same rows: own file, exactly
                return check_rank_state(folder, tensors, header, step, state), notes
        if target is None:
            raise CheckpointError(
                f"{folder}: saved by {saved_ws} processes, this run has {self.world.world_size}, "
                "and this train state does not say which global batch rows it trains (layout), "
                f"so per-rank state cannot be mapped; run with {saved_ws} processes"
            )
        files = [rank_file(folder, r) for r in range(saved_ws)]
        mapped = remap.map_rank_state(folder, files, step, target, set(state.guards))
        check_payload_fits(folder, str(folder), mapped.payload, mapped.loader, step, state)
        notes += [*mapped.notes, "RNG: not carried over; every step derives it from "
                  "(training.seed, step)"]
        return (None, None, mapped.payload, mapped.loader), notes

    def verify(self, folder: Path) -> str | None:
        """Rank 0 hashes the folder against its manifest; every rank gets the same verdict
        (None = valid, else the error message)."""
        error = None
        if self.world.is_main:
            try:
                layout.verify(folder, hashes=True)
            except CheckpointError as exc:
                error = str(exc)
        return distributed.broadcast_object(error) if self.world.distributed else error


"""Save and load a run's complete state through DCP, atomically, optionally in the background.

The manager works on a *train state*: any object with ``model``, ``optimizers`` (an
``OptimizerSet`` or a dict name -> optimizer), ``progress`` (``state_dict``/``load_state_dict``),
``guards`` (dict), ``world`` (``kiln.components.distributed.World``) and optionally
``recipe_toml`` (the resolved recipe's text, copied into every snapshot), ``train_loader``
(``state_dict``/``load_state_dict``) and ``layout`` (a JSON dict: ``world_size``, ``mesh``,
``fsdp``, ``global_batch``, ``micro_batch``, ``grad_accum`` and this rank's global-batch
``rows``). The trainer is one; tests use small ones.

Model and optimizers go through ``get_state_dict``/``set_state_dict`` so plain and FSDP2-sharded
models share one path (DCP reshards tensors across layouts). Everything per-rank (RNG, the
model's carry, the loader cursor) goes into the rank's safetensors file; on the same layout each
rank reads its own file back, on another layout ``remap`` assembles it by global batch row.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from kiln.checkpointing import layout, payload, rank_json, remap, rng, storage
from kiln.checkpointing.load_checks import (
    QKV_ROWS,
    STATE,
    check_groups,
    check_payload_fits,
    check_qkv_rows,
    check_rank_state,
    rank_file,
    read_state,
)
from kiln.components import distributed
from kiln.components.errors import CheckpointError

RECIPE = "recipe.toml"


def optimizers_of(state) -> dict[str, torch.optim.Optimizer]:
    opts = state.optimizers
    return dict(opts.optimizers) if hasattr(opts, "optimizers") else dict(opts)


@dataclass
class Loaded:
    """What a load restored (for the caller's report)."""

    folder: Path
    step: int
    weights_only: bool
    saved_world_size: int
    mapping: list[str] = field(default_factory=list)  # how a changed layout was mapped


class CheckpointManager:
    def __init__(self, root: Path, world, *, keep_last: int = 3, async_save: bool = False,
                 on_publish: Callable[[Path], None] | None = None, log=print) -> None:
        self.root = Path(root)
        self.world = world
        self.keep_last = keep_last
        self.async_save = async_save
        self.on_publish = on_publish
        self.log = log
        self._pending: dict[str, Any] | None = None  # the one save in flight
        self.last_saved_step: int | None = None
        self.last_save_s: float | None = None  # how long the last save took to write, in full
        self.failures: list[str] = []
        # Background saves need their own process group: DCP's collectives then never
        # interleave with the training loop's on the default group.
        self._pg = dist.new_group(backend="gloo") if async_save and world.distributed else None

    # ------------------------------------------------------------------------------- saving
    def save(self, state, *, extra: dict[str, Any] | None = None) -> Path:
        """Save the state at its current step; returns the folder it will be published as."""
        self.wait()
        started = time.monotonic()
        step = int(state.progress.step)
        name = layout.step_name(step)
        tmp = self.root / f"{layout.TMP_PREFIX}{name}"
        if self.world.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            layout.remove_temporaries(self.root)
            tmp.mkdir()
        distributed.barrier()

        # Small per-rank state first, synchronously: it must be captured at this step.
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

        tensors, rest = storage.split_tree(self._app_state(state, with_optim=True))
        rest = rank_json.merge(distributed.all_gather_object(rest))  # pipeline stages differ
        meta = {
            "format": layout.FORMAT, "step": step, "tokens": int(state.progress.tokens),
            "world_size": self.world.world_size, "progress": state.progress.state_dict(),
            "optimizers": sorted(optimizers_of(state)), "json_state": rest,
            "layout": storage.to_json({k: v for k, v in (state_layout or {}).items()
                                       if k != "rows"}, "layout"),
            "qkv_rows": QKV_ROWS,
        }
        seal = {"tokens": int(state.progress.tokens), "world_size": self.world.world_size,
                "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(extra or {})}
        if self.world.is_main:
            layout.write_json(tmp / STATE, meta)
            recipe_toml = getattr(state, "recipe_toml", None)
            if recipe_toml is not None:
                layout.write_atomic(tmp / RECIPE, recipe_toml)
        writer = FileSystemWriter(str(tmp), sync_files=True)
        if not self.async_save:
            storage.quiet_dcp()
            dcp.save(tensors, storage_writer=writer, no_dist=not self.world.distributed)
            distributed.barrier()
            if self.world.is_main:
                self._publish(tmp, step, seal)
            distributed.barrier()
            self.last_saved_step = step
            self.last_save_s = time.monotonic() - started
            return self.root / name

        storage.quiet_dcp()
        future = dcp.async_save(tensors, storage_writer=writer, process_group=self._pg,
                                no_dist=not self.world.distributed)
        marker = self.root / f"{layout.TMP_PREFIX}{name}.done.{self.world.rank}"
        future.add_done_callback(lambda f: _write_marker(marker, f))
        future.add_done_callback(
            lambda f: setattr(self, "last_save_s", time.monotonic() - started))
        pending: dict[str, Any] = {"future": future, "step": step}
        if self.world.is_main:
            thread = threading.Thread(target=self._finish_async, args=(tmp, step, seal),
                                      name="kiln-checkpoint", daemon=True)
            thread.start()
            pending["thread"] = thread
        self._pending = pending
        self.last_saved_step = step
        return self.root / name

    def wait(self) -> None:
        """Block until the save in flight (if any) is published."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending["future"].result()
        except Exception as exc:  # reported below; the previous checkpoint stays the latest
            self.failures.append(f"step {pending['step']}: {exc}")
        if "thread" in pending:
            pending["thread"].join()
        for msg in self.failures:
            self.log(f"kiln: checkpoint save FAILED ({msg}); the previous checkpoint is kept")
        self.failures.clear()

    def _finish_async(self, tmp: Path, step: int, seal: dict[str, Any]) -> None:
        markers = [self.root / f"{tmp.name}.done.{r}" for r in range(self.world.world_size)]
        deadline = time.monotonic() + float(os.environ.get("KILN_CKPT_TIMEOUT_S", "3600"))
        while not all(m.exists() for m in markers):
            if time.monotonic() > deadline:
                self.failures.append(f"step {step}: timed out waiting for every rank's write")
                return
            time.sleep(0.05)
        errors = [m.read_text() for m in markers if m.read_text() != "ok"]
        for m in markers:
            m.unlink(missing_ok=True)
        if errors:
            self.failures.append(f"step {step}: {errors[0]}")
            return
        try:
            self._publish(tmp, step, seal)
        except Exception as exc:  # a failed publish must not kill training; wait() reports it
            self.failures.append(f"step {step}: publishing failed: {exc}")

    def _publish(self, tmp: Path, step: int, seal: dict[str, Any]) -> None:
        """Rank 0: seal, rename into place, point ``latest`` at it, rotate, index."""
        name = layout.step_name(step)
        layout.write_manifest(tmp, step, seal)
        layout.publish(tmp, self.root / name)
        layout.write_atomic(self.root / "latest", name + "\n")
        removed = layout.rotate(self.root, self.keep_last)
        layout.write_index(self.root)
        self.log(f"kiln: checkpoint step {step} -> {self.root / name}"
                 + (f" (rotated out {', '.join(removed)})" if removed else ""))
        if self.on_publish is not None:
            self.on_publish(self.root / name)

    def mark_final(self, step: int) -> None:
        """Point ``final`` at the checkpoint of ``step`` (rank 0; after ``wait``)."""
        self.wait()
        if self.world.is_main:
            layout.set_link(self.root, "final", layout.step_name(step))
            layout.write_index(self.root)
        distributed.barrier()

    # ------------------------------------------------------------------------------ loading
    def load(self, state, folder: Path, *, weights_only: bool = False,
             from_ema: bool = False, verified: bool = False) -> Loaded:
        """Restore ``state`` from a checkpoint folder; validates before changing anything.
        ``verified``: the caller has just checked the folder's hashes (``verify``)."""
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

        with_optim = not weights_only or from_ema
        current = self._app_state(state, with_optim=with_optim)
        tensors, current_rest = storage.split_tree(current)
        storage.load_tensors(
            tensors, folder, no_dist=not self.world.distributed,
            hint=" -- the saved tensors do not fit this model/optimizer; did the model or "
            "optimizer change? `kiln diff` the checkpoint against the recipe")
        self._apply_app_state(state, tensors, meta["json_state"], with_optim, folder,
                              current_rest.get("model", {}))

        if weights_only:
            if from_ema:
                swapped = [n for n, o in optimizers_of(state).items() if hasattr(o, "swap_ema")]
                if not swapped:
                    raise CheckpointError(
                        "checkpoint.from_ema = true, but none of the optimizers "
                        f"({', '.join(optimizers_of(state))}) keeps EMA weights (swap_ema)"
                    )
                for name in swapped:
                    optimizers_of(state)[name].swap_ema()
            for opt in optimizers_of(state).values():
                opt.state.clear()  # fresh moments: a new run that starts from these weights
            return Loaded(folder, step, True, saved_ws)

        rng_tensors, rng_info, pay, loader_state = ranked
        state.progress.load_state_dict(meta["progress"])
        for name, guard in state.guards.items():
            guard.load_state_dict(pay["guard_fields"][name])
        if pay["carry"] is not None:
            state.model.load_carry_state(
                {k: v.to(_device_of(state.model)) for k, v in pay["carry"].items()})
        loader = getattr(state, "train_loader", None)
        if loader is not None and loader_state is not None:
            loader.load_state_dict(loader_state)
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

    # -------------------------------------------------------------------- model + optimizers
    def _app_state(self, state, *, with_optim: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"model": get_model_state_dict(state.model)}
        if with_optim:
            out["optimizer"] = {name: get_optimizer_state_dict(state.model, opt)
                                for name, opt in optimizers_of(state).items()}
        return out

    def _apply_app_state(self, state, tensors: dict, saved_rest: dict, with_optim: bool,
                         folder: Path, model_rest: dict) -> None:
        # The saved JSON parts hold every rank's entries (rank_json): keep this rank's.
        mine = {k: v for k, v in saved_rest.get("model", {}).items() if k in model_rest}
        model_sd = storage.merge_tree(tensors["model"], mine)
        set_model_state_dict(state.model, model_sd)
        if not with_optim:
            return
        saved_opt = saved_rest.get("optimizer", {})
        for name, opt in optimizers_of(state).items():
            # An optimizer without tensor state (sign-SGD without momentum) has no tensors.
            loaded, saved = tensors.get("optimizer", {}).get(name, {}), saved_opt.get(name)
            if not isinstance(saved, dict) or "param_groups" not in saved:
                raise CheckpointError(f"{folder}: no state for optimizer {name!r}")
            current_groups = get_optimizer_state_dict(state.model, opt)["param_groups"]
            every = distributed.all_gather_object(current_groups)  # all pipeline stages
            merged = every[0]
            for groups in every[1:]:
                merged = rank_json.merge_groups(merged, groups)
            check_groups(folder, name, saved["param_groups"], merged)
            # Hyperparameters come from the current recipe (LR is set from the schedule every
            # step); the moments and any non-tensor per-parameter state come from the checkpoint.
            names = {str(p) for g in current_groups for p in g.get("params", [])}
            sd = storage.merge_tree(loaded, {"state": rank_json.own_state(
                saved.get("state", {}), names)})
            sd["param_groups"] = current_groups
            set_optimizer_state_dict(state.model, opt, sd)


# ---------------------------------------------------------------------------------- helpers
def _write_marker(path: Path, future) -> None:
    exc = future.exception()
    text = "ok" if exc is None else f"{type(exc).__name__}: {_short(exc)}"
    layout.write_atomic(path, text)


def _device_of(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


def _short(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + " ..."

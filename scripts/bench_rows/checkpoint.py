"""Checkpoint save and load throughput (MB/s of tensor state): kiln's ``CheckpointManager``
(DCP tensors + rank file with RNG and runtime payload + manifest with a checksum of each file,
written to a temporary folder and renamed into place, ``latest``/index updated, old ones rotated
out, their deletion in the background and untimed; loading verifies every checksum first)
against a bare ``dcp.save`` / ``dcp.load`` of the same state (``get_state_dict`` /
``set_state_dict``, torch's documented recipe). Both write with ``sync_files`` (fsync), into
fresh folders on the same disk.

The state: ``train_configs/llama_debug.toml``'s model (6.16M parameters, fp32) and its AdamW
after one step (moments filled): 74 MB. Both sides build it with kiln (the peer needs only torch;
it runs in kiln's interpreter).
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from pathlib import Path

from bench_rows.common import LLAMA_DEBUG, set_threads


def _state():
    """(model, AdamW) after one step, and the bytes of their tensors."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from kiln.recipes.config.files import load_recipe

    recipe = load_recipe(LLAMA_DEBUG, [])
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=2048, seq_len=256)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model(torch.zeros(1, 8, dtype=torch.long)).float().mean().backward()
    opt.step()
    size = sum(t.numel() * t.element_size() for t in get_model_state_dict(model).values())
    size += sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    return recipe, model, opt, size


def _timed(save, load, repeats: int, size: int, settle=None) -> dict:
    """``settle()``, untimed, between a save and the load: kiln's rotation deletes the snapshot
    a save rotated out in a background thread (off a training step's path), which would
    otherwise run during the timed load; bare DCP deletes nothing."""
    saves, loads = [], []
    for _ in range(repeats + 1):  # the first of each is a warm-up
        start = time.perf_counter()
        folder = save()
        saves.append(time.perf_counter() - start)
        if settle is not None:
            settle()
        start = time.perf_counter()
        load(folder)
        loads.append(time.perf_counter() - start)
    save_s, load_s = statistics.median(saves[1:]), statistics.median(loads[1:])
    return {"save_mb_per_s": size / 1e6 / save_s, "load_mb_per_s": size / 1e6 / load_s,
            "save_s": save_s, "load_s": load_s, "megabytes": size / 1e6}


def kiln(p: dict) -> dict:
    import torch

    from kiln.checkpointing.manager import CheckpointManager
    from kiln.components.distributed import World
    from kiln.recipes.config.files import render_recipe
    from kiln.recipes.training.trainer import Progress

    set_threads(p["threads"])
    recipe, model, opt, size = _state()

    class State:  # the train state the manager saves (the trainer is one)
        def __init__(self) -> None:
            self.model, self.optimizers, self.guards = model, {"main": opt}, {}
            self.progress, self.recipe_toml = Progress(), render_recipe(recipe)
            self.world = World(0, 1, 0, torch.device("cpu"))

    state = State()
    with tempfile.TemporaryDirectory(dir=p["work"]) as tmp:
        manager = CheckpointManager(Path(tmp), state.world, log=lambda _: None)

        def save() -> Path:
            state.progress.step += 1
            return manager.save(state)

        return _timed(save, lambda folder: manager.load(state, folder), p["repeats"], size,
                      settle=manager.wait)


def peer(p: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    set_threads(p["threads"])
    _, model, opt, size = _state()
    counter = itertools.count()
    with tempfile.TemporaryDirectory(dir=p["work"]) as tmp:

        def save() -> Path:
            folder = Path(tmp) / f"step_{next(counter)}"
            model_sd, opt_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optimizer": opt_sd}, checkpoint_id=folder,
                     no_dist=True)
            return folder

        def load(folder: Path) -> None:
            model_sd, opt_sd = get_state_dict(model, opt)
            sd = {"model": model_sd, "optimizer": opt_sd}
            dcp.load(sd, checkpoint_id=folder, no_dist=True)
            set_state_dict(model, opt, model_state_dict=sd["model"],
                           optim_state_dict=sd["optimizer"])

        return _timed(save, load, p["repeats"], size)

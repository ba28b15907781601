"""What a saved checkpoint must satisfy before it is loaded into this run: a well-formed run
state, per-rank state that validates, a payload that fits the run, the optimizer groups and the
fused-QKV row order it was trained with. Each check raises one ``CheckpointError`` naming the
file and the way out, before anything in the run has changed."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.checkpointing import layout, payload, rng
from kiln.components.errors import CheckpointError, DataError

STATE = "state.json"
QKV_ROWS = "kv_grouped"  # row order of a fused wqkv (causal.split_fused_rows), since v0.2


def rank_file(folder: Path, rank: int) -> Path:
    return folder / f"rank_{rank:05d}.safetensors"


def read_state(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / STATE).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{folder / STATE}: unreadable ({exc})") from exc
    required = {"format", "step", "tokens", "world_size", "progress", "optimizers", "json_state"}
    optional = {"layout", "qkv_rows", "data", "base", "frozen"}
    if not isinstance(meta, dict) or not required <= set(meta) <= required | optional \
            or meta["format"] != layout.FORMAT \
            or type(meta["step"]) is not int or type(meta["world_size"]) is not int \
            or not isinstance(meta["json_state"], dict) or not isinstance(meta["progress"], dict) \
            or meta["progress"].get("step") != meta["step"]:
        raise CheckpointError(f"{folder / STATE}: malformed run state (edited or corrupt)")
    return meta


def check_qkv_rows(folder: Path, meta: dict, model: torch.nn.Module) -> None:
    """A fused ``wqkv`` saved before its rows were grouped per kv head (v0.1: [q; k; v]) would
    load with its rows permuted: refuse it (models without ``wqkv`` are unaffected)."""
    if meta.get("qkv_rows") == QKV_ROWS:
        return
    if any(name.endswith("wqkv.weight") for name, _ in model.named_parameters()):
        raise CheckpointError(
            f"{folder}: saved by a kiln whose fused wqkv rows were [q; k; v]; this kiln groups "
            "them per kv head (tensor parallelism shards them). Export it with the kiln that "
            "wrote it (`kiln export`: the Hugging Face layout, for dense Llama-shaped models) "
            "and start from that export with checkpoint.init_from, or start afresh")


def check_rank_state(folder: Path, tensors: dict, header: dict, step: int, state):
    where = str(rank_file(folder, header.get("rank", -1)))
    rng_tensors = {k: v for k, v in tensors.items() if k.startswith(rng.PREFIX)}
    other = {k: v for k, v in tensors.items() if not k.startswith(rng.PREFIX)}
    rng._validate(rng_tensors, header["rng"], where)
    pay = payload.join(other, header["payload"], where)
    pay = payload.validate(pay, expected_step=step, guard_names=set(state.guards), where=where)
    if header["rank"] != state.world.rank or header["world_size"] != state.world.world_size:
        raise CheckpointError(f"{where}: written for rank {header['rank']} of "
                              f"{header['world_size']}, read by rank {state.world.rank}")
    check_payload_fits(folder, where, pay, header["loader"], step, state)
    return rng_tensors, header["rng"], pay, header["loader"]


def check_payload_fits(folder: Path, where: str, pay: dict, loader_state, step: int,
                        state) -> None:
    aborted = payload.aborted_guards(pay)
    if aborted:
        raise CheckpointError(
            f"{folder}: guard(s) {aborted} had aborted training at step {step}; a full resume "
            "would continue a run that was stopped on purpose. Roll back to an earlier "
            "checkpoint, or set checkpoint.weights_only = true to start fresh guard history"
        )
    if pay["carry"] is not None and getattr(state.model, "load_carry_state", None) is None:
        raise CheckpointError(f"{where}: the checkpoint holds a carried state but this model "
                              "cannot load one (load_carry_state); was the model changed?")
    loader = getattr(state, "train_loader", None)
    if loader is not None and hasattr(loader, "load_state_dict") and loader_state is None:
        raise CheckpointError(f"{where}: no data loader cursor saved; cannot resume exactly")
    check = getattr(loader, "check_state_dict", None)  # optional: the loaders kiln ships have it
    if check is not None and loader_state is not None:
        try:
            check(loader_state)
        except DataError as exc:
            raise CheckpointError(f"{where}: data loader cursor: {exc}") from None


def check_groups(folder: Path, name: str, saved: list, current: list) -> None:
    """The saved optimizer trained the same parameters in the same logical groups (by group
    name: parallelism may split one group by device mesh, differently on another layout)."""
    def members(groups: list) -> dict:
        out: dict = {}
        for i, g in enumerate(groups):
            out.setdefault(g.get("name", i), set()).update(str(p) for p in g.get("params", []))
        return out

    was, now = members(saved), members(current)
    if was != now:
        old, new = set().union(*was.values()), set().union(*now.values())
        diff = "".join(f"{label}: {', '.join(sorted(names)[:3])}; " for label, names in
                       (("only saved", old - new), ("only now", new - old)) if names)
        if not diff:  # the same parameters, grouped differently
            sizes = [{k: len(v) for k, v in groups.items()} for groups in (was, now)]
            diff = f"groups {sizes[0]} -> {sizes[1]}; "
        raise CheckpointError(
            f"{folder}: optimizer {name!r} trained different parameters or parameter groups "
            f"than the recipe builds now ({diff}routing / no_decay rules changed?); resume "
            "with the original optimizer tables, or set checkpoint.weights_only = true"
        )


@dataclass
class Loaded:
    """What a load restored (for the caller's report)."""

    folder: Path
    step: int
    weights_only: bool
    saved_world_size: int
    mapping: list[str] = field(default_factory=list)  # how a changed layout was mapped


def device_of(model: torch.nn.Module) -> torch.device:
    """Where the model's parameters are (the CPU for a model without any)."""
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")

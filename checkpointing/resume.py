"""Where a run resumes from, and whether the recipe may have changed since the checkpoint.

``resume = "auto"`` continues the run's own newest complete checkpoint, so rerunning the same
command after a crash or a preemption continues. An explicit path outside the run's folder (a
checkpoint, a checkpoints folder or a run folder) seeds a new run; once that run has checkpoints
of its own, rerunning continues those. An explicit path inside the run's own folder is a
rollback: newer checkpoints are moved aside to ``abandoned/`` so ``auto`` cannot pick them up,
and ``rollback.json`` remembers it, so rerunning the same command continues after the rollback
instead of rolling back again.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from kiln.checkpointing import layout
from kiln.components.errors import CheckpointError, DataError, RecipeError

ROLLBACK = "rollback.json"  # the last rollback's target, so rerunning the command continues
KEY = "checkpoint.resume"  # the recipe key resolve() reads, named in its errors
CORRUPT = "corrupt"  # snapshots that failed verification, moved aside by unattended recovery
PREVIOUS = "previous"  # an earlier run's snapshots, moved aside when resume = "off" starts over


@dataclass
class Source:
    folder: Path
    explicit: bool  # chosen by the recipe (a rollback or a new run's seed), not by "auto"
    note: str = ""


def find_checkpoint(path: Path, key: str = "") -> Path:
    """A checkpoint folder given a checkpoint, checkpoints or run folder. ``key`` is the recipe
    key the path came from (``checkpoint.resume``), named in errors; a command's argument
    (``kiln generate RUN``) leaves it empty, so the message talks about the folder given."""
    path = Path(path)
    if (path / layout.MANIFEST).is_file() or (path / "state.json").is_file():
        return path
    for root in (path / "checkpoints", path):
        found = layout.newest_complete(root) if root.is_dir() else None
        if found is not None:
            return found
    if not path.exists():
        problem = "does not exist"
    elif not path.is_dir():
        problem = "is not a folder"
    else:
        unfinished = [p.name for _, p in layout.list_checkpoints(path / "checkpoints")
                      + layout.list_checkpoints(path)]
        problem = "holds no checkpoint" if not unfinished else (
            f"holds no complete checkpoint ({', '.join(unfinished)}: saves that did not finish)")
    where = f"{key} = {str(path)!r}: the folder {problem}" if key else f"{path} {problem}"
    also = ', or set resume = "off"' if key == "checkpoint.resume" else ""
    raise CheckpointError(f"{where}; give a run folder (runs/NAME), its checkpoints folder or "
                          f"one step_XXXXXXX folder{also}")


def resolve(resume: str, root: Path, *, download=None) -> Source | None:
    """The checkpoint to resume from (None = start fresh). ``download(spec) -> Path`` fetches
    ``hf://`` sources."""
    if resume == "off":
        return None
    own = layout.newest_complete(root) if root.is_dir() else None
    if resume == "auto":
        return Source(own, explicit=False) if own is not None else None
    if resume.startswith("hf://"):
        if own is not None:
            return Source(own, False, f"continuing this run's own checkpoint {own.name} "
                          f"(not re-downloading {resume})")
        if download is None:
            raise CheckpointError("hf:// resume needs huggingface_hub")
        return Source(find_checkpoint(download(resume), KEY), explicit=True)
    target = find_checkpoint(Path(resume).expanduser(), KEY)
    inside = _inside(target, root)
    if not inside and own is not None:
        return Source(own, False, f"continuing this run's own checkpoint {own.name}; "
                      f"{resume} only seeded it (point resume inside {root} to roll back)")
    if inside and own is not None and own.resolve() != target.resolve() \
            and _rolled_back_to(root) == target.resolve().name:
        # The same command again after a rollback: the newer checkpoints are its continuation.
        return Source(own, False, f"already rolled back to {target.name}; continuing from "
                      f"{own.name}")
    return Source(target, explicit=True)


def _rolled_back_to(root: Path) -> str | None:
    path = root / ROLLBACK
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("to")
    except (ValueError, AttributeError):
        return None


def abandon_newer(root: Path, folder: Path) -> list[str]:
    """A rollback: move checkpoints newer than ``folder`` to ``root/abandoned`` (rank 0)."""
    step = layout.step_of(folder.resolve().name)
    if step is None or not _inside(folder, root):
        return []
    moved = []
    for s, p in layout.list_checkpoints(root):
        if s > step:
            dest = root / "abandoned" / p.name
            dest.parent.mkdir(exist_ok=True)
            if dest.exists():
                shutil.rmtree(dest)
            p.rename(dest)
            moved.append(p.name)
    layout.write_json(root / ROLLBACK, {"to": folder.resolve().name, "abandoned": moved})
    if moved:
        layout.write_atomic(root / "latest", folder.resolve().name + "\n")
        layout.write_index(root)
    return moved


def quarantine(root: Path, folder: Path) -> Path:
    """Move a snapshot that failed verification to ``root/corrupt/`` (rank 0), so ``auto`` no
    longer picks it; ``latest``, ``final`` and the index stop pointing at it. Returns where it
    went (kept for inspection, never deleted)."""
    dest = root / CORRUPT / folder.name
    dest.parent.mkdir(exist_ok=True)
    n = 1
    while dest.exists():
        dest, n = root / CORRUPT / f"{folder.name}.{n}", n + 1
    folder.rename(dest)
    if layout.link_target(root, "final") == folder.name:
        (root / "final").unlink()
    newest = layout.newest_complete(root, warn=False)
    if newest is not None:
        layout.write_atomic(root / "latest", newest.name + "\n")
    else:
        (root / "latest").unlink(missing_ok=True)
    layout.write_index(root)
    return dest


def set_aside_previous(root: Path) -> tuple[list[str], Path | None]:
    """``resume = "off"`` in a run folder that holds snapshots: move them all (complete or not)
    to ``root/previous/N/`` (N: one more than the last such start-over), and drop ``latest`` and
    ``final``, so the new run's saves, its rotation and a later ``auto`` resume see only its own
    snapshots, and nothing of the earlier run is lost (rank 0). Returns (the names, where)."""
    found = layout.list_checkpoints(root)
    if not found:
        return [], None
    earlier = [int(p.name) for p in (root / PREVIOUS).glob("*") if p.name.isdigit()]
    dest = root / PREVIOUS / str(max(earlier, default=0) + 1)
    dest.mkdir(parents=True)
    for _, folder in found:
        folder.rename(dest / folder.name)
    for name in ("final", "latest"):
        path = root / name
        if path.is_dir() and not path.is_symlink():  # a copy of the run that followed links
            path.rename(dest / name)
        else:
            path.unlink(missing_ok=True)
    layout.write_index(root)
    return [folder.name for _, folder in found], dest


def quarantined(root: Path) -> list[str]:
    """What earlier starts set aside in ``root/corrupt/`` (paths, oldest name first)."""
    folder = root / CORRUPT
    return [str(p) for p in sorted(folder.iterdir())] if folder.is_dir() else []


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


# ---------------------------------------------------------------------- recipe compatibility
# Keys whose change leaves the saved tensors or cursors meaningless for an exact resume.
# (an [adapter]'s type, rank, targets and alpha too: its saved tensors' shapes, and its scale)
_STATE_KEYS = ("model.", "tokenizer.", "adapter.")
_DATA_KEYS = ("data.", "training.seed", "training.seq_len", "training.global_batch")
_INIT_ONLY = ("model.init_std", "model.depth_init")  # used only to initialise fresh weights
# Training settings of the model table, read each step like the LR: dropout rates and the
# weights of its auxiliary losses (and an adapter's dropout, and whether it may start from a
# random base). They leave the saved tensors' shapes and meaning as they are (turning dropout
# off for an anneal was refused as if it changed the weights).
_TRAIN_ONLY = re.compile(r"^model\.(?:[a-z_]+\.)?(?:dropout|mtp_weight|aux_loss_coeff|"
                         r"bias_update_coeff|capacity_factor)$|^adapter\.(?:dropout|"
                         r"allow_random_base)$")
# How the data is loaded, not which: the cursor is a position whatever the workers, read-ahead
# or pinned memory (a streaming cursor that records its workers checks them itself).
_LOADER_ONLY = re.compile(r"^data\.(?:sources\.[^.]+\.)?(?:num_workers|prefetch|pin_memory)$")
# Where a source's data lives: the same data moved (another machine, a faster disk) resumes if
# the source records a fingerprint, which ``check_data`` compares; streaming_text and
# balanced_shards record none, so nothing would check what a new path holds: refused.
_LOCATION = re.compile(r"^(data(?:\.sources\.[^.]+)?)\.(?:path|cache_dir|source_path)$")
_OPT_TYPE = re.compile(r"^(optimizer|optimizers\.[^.]+)\.type$")


@dataclass
class Compatibility:
    refused: list[str]
    allowed: list[str]


def check_recipe(d, *, weights_only: bool,
                 fingerprinted: frozenset[str] = frozenset()) -> Compatibility:
    """Classify the differences between the checkpoint's recipe and the current one. ``d`` is
    their diff (``kiln.recipes.config.diff.RecipeDiff``: ``keys()``, ``changed``, ``only_a``
    for keys only the checkpoint has, ``only_b`` for keys only the current recipe has).
    ``fingerprinted``: the data sources (``data``, ``data.sources.NAME``) whose fingerprint the
    checkpoint and this run both record, which may therefore move (``_LOCATION``)."""
    refused, allowed = [], []
    for key in d.keys():  # noqa: SIM118 (RecipeDiff.keys(), not a dict)
        line = _describe(d, key)
        moved = (m := _LOCATION.match(key)) is not None and m.group(1) in fingerprinted
        why = "" if moved else _refusal(key, d, weights_only)
        (refused if why else allowed).append(f"{line}  ({why})" if why else line)
    return Compatibility(refused, allowed)


def _refusal(key: str, d, weights_only: bool) -> str:
    if key.startswith(_INIT_ONLY) or _TRAIN_ONLY.match(key) or _LOADER_ONLY.match(key):
        return ""
    if key.startswith(_STATE_KEYS):
        return "changes the weights' shapes or meaning"
    if weights_only:
        return ""
    if key.startswith(_DATA_KEYS):
        return "the saved data cursor would point elsewhere"
    if key.startswith(("optimizer.", "optimizers.")):
        if _OPT_TYPE.match(key):
            return "changes the optimizer type"
        if ".params." in key or ".no_decay." in key or key.endswith((".params", ".no_decay")):
            return "changes which parameters the optimizer trains"
        if key.endswith(".block_size"):
            return "changes the blocks of the quantised optimizer state"
        if ".schedule." not in key and (key in d.only_a or key in d.only_b):
            return "adds or removes an optimizer (or changes its type)"
    if key.startswith("guards.") and (key in d.only_a or key in d.only_b):
        return "adds or removes a guard (its saved history must match)"
    return ""


def _describe(d, key: str) -> str:
    if key in d.changed:
        a, b = d.changed[key]
        return f"{key}: {a!r} -> {b!r}"
    if key in d.only_a:
        return f"{key}: removed (was {d.only_a[key]!r})"
    return f"{key}: added ({d.only_b[key]!r})"


def compare_with_checkpoint(folder: Path, recipe_diff, *, weights_only: bool, log,
                            data_record: dict | None = None) -> None:
    """Refuse incompatible recipe changes (CheckpointError); report allowed ones via ``log``.
    ``recipe_diff(folder)`` diffs the checkpoint's recipe against the current one (the trainer
    passes it: reading recipes is the recipes package's job); RecipeError = unreadable.
    ``data_record``: this run's (``check_data``), for the sources that may move."""
    try:
        d = recipe_diff(folder)
    except RecipeError as exc:
        log(f"kiln: warning: cannot read the checkpoint's recipe to compare ({exc}); resuming "
            "without the recipe check")
        return
    result = check_recipe(d, weights_only=weights_only, fingerprinted=frozenset() if weights_only
                          else _fingerprinted(folder, data_record))  # (weights_only: any data)
    if result.refused:
        raise CheckpointError(
            f"{folder}: the recipe changed in ways this checkpoint cannot follow:\n  "
            + "\n  ".join(result.refused)
            + "\nRestore those keys (see `kiln diff " + str(folder) + " RECIPE`), resume with "
            "checkpoint.weights_only = true to start a new schedule from these weights (shapes "
            "must still match), or set checkpoint.resume = \"off\" to start fresh."
        )
    if result.allowed:
        log("kiln: recipe changed since the checkpoint (allowed):\n  "
            + "\n  ".join(result.allowed))


# ------------------------------------------------------------------------ data compatibility
def _fingerprinted(folder: Path, record: dict | None) -> frozenset[str]:
    """The sources whose data fingerprint checkpoint ``folder`` and ``record`` both hold."""
    from kiln.checkpointing.load_checks import read_state

    saved = read_state(folder).get("data") if record is not None else None
    if not isinstance(saved, dict) or not isinstance(saved.get("fingerprints"), dict):
        return frozenset()
    now = record.get("fingerprints", {})
    return frozenset(k for k, v in saved["fingerprints"].items() if v and now.get(k))


def check_data(folder: Path, record: dict | None, *, policy: str, pin=None,
               total_steps: int = 0) -> list[str]:
    """The data the checkpoint's cursor points into against this run's (``record``: the
    trainer's ``data_record``, fingerprints by recipe key and mixture stage steps). Changed
    data is refused naming the source (CheckpointError), or with ``policy = "continue"`` said
    in one line; ``pin(saved stage steps, resume step, total_steps)`` keeps the stages a
    changed run length would move (``Mixture.pin_stages``). Lines for the log."""
    from kiln.checkpointing.load_checks import read_state

    meta = read_state(folder)
    saved = meta.get("data")
    if record is None:
        return []
    if not isinstance(saved, dict) or not isinstance(saved.get("fingerprints"), dict):
        return [f"kiln: note: {folder.name} records no data fingerprints (saved by an older "
                "kiln): the data is not checked against it"]
    before, now = saved["fingerprints"], record.get("fingerprints", {})
    changed = sorted(k for k in {*before, *now} if before.get(k) != now.get(k))
    lines = []
    if changed:
        names = ", ".join(changed)
        if policy != "continue":
            raise CheckpointError(
                f"{folder}: {names} changed since this checkpoint (its files were edited, "
                "truncated or deleted, or the recipe or kiln now builds or splits it otherwise), "
                "so its data cursor would point into other data; "
                "restore the data, rerun with --checkpoint.on_data_change=continue to go on from "
                "the saved cursor on the new data, or with --checkpoint.resume=off to start afresh")
        lines.append(f"kiln: warning: {names} changed since {folder.name}; continuing from the "
                     "saved cursor on the new data (checkpoint.on_data_change = \"continue\")")
    stages = saved.get("stages")
    if pin is not None and isinstance(stages, list) and stages:
        try:
            lines += pin(stages, int(meta["step"]), total_steps)
        except DataError as exc:
            raise CheckpointError(f"{folder}: {exc}") from None
    return lines


def parent_record(folder: Path, how: str) -> dict:
    """Where a run that starts from checkpoint ``folder``'s weights comes from: the run that
    saved it, the checkpoint, its step and tokens (``RUN/parent.json``: ``kiln plot`` draws
    the new run at its true offset, and joined with its parent)."""
    from kiln.checkpointing.load_checks import read_state

    folder = Path(folder).resolve()
    meta = read_state(folder)
    return {"run": str(folder.parent.parent), "checkpoint": str(folder), "how": how,
            "step": int(meta["step"]), "tokens": int(meta["tokens"])}


def check_base(folder: Path, record: dict | None, place) -> str:
    """An adapters-only checkpoint against the base it is about to be used with: ``record`` is
    {init_from, fingerprint} of that base (``importer.content_fingerprint``). Other weights are
    refused (CheckpointError); the same weights at another place are fine (a line for the
    log). Checkpoints saved before fingerprints were recorded are checked by place
    (``place(spec)``: a comparable path)."""
    from kiln.checkpointing.load_checks import read_state

    saved = read_state(Path(folder)).get("base")
    if record is None:
        return ""
    if not isinstance(saved, dict) or not isinstance(saved.get("fingerprint"), str):
        base = _recipe_init_from(Path(folder))
        if base is not None and place(base) != place(record["init_from"]):
            raise CheckpointError(
                f"{folder} holds LoRA adapters trained on checkpoint.init_from = {base!r}, "
                f"this recipe names {record['init_from']!r}; resume with that base (the "
                "adapters alone mean nothing on another)")
        return ""
    if saved["fingerprint"] != record["fingerprint"]:
        raise CheckpointError(
            f"{folder} holds LoRA adapters trained on other base weights than "
            f"checkpoint.init_from = {record['init_from']!r} now holds (weights fingerprint "
            f"{record['fingerprint'][:12]}, the adapters' base {saved['fingerprint'][:12]}); "
            "restore the base they were trained on (the adapters alone mean nothing on "
            "another), or start a new run from this base")
    if place(str(saved.get("init_from", ""))) != place(record["init_from"]):
        return (f"kiln: the adapters' base moved: {saved.get('init_from')!r} is now "
                f"{record['init_from']!r}, with the same weights")
    return ""


def _recipe_init_from(folder: Path) -> str | None:
    import tomllib

    try:
        data = tomllib.loads((folder / "recipe.toml").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("checkpoint", {}).get("init_from")
    return value if isinstance(value, str) else None

"""The on-disk layout of a run's checkpoints, and the file operations that keep it consistent.

::

    RUN/checkpoints/
      step_0001000/           one complete checkpoint (immutable once renamed into place)
        .metadata __0_0.distcp ...   DCP: model and optimizer tensors (all ranks)
        rank_00000.safetensors       per rank: RNG, carry; JSON header: payload, loader cursor
        state.json                   progress, world size, non-tensor optimizer/model state
        recipe.toml                  the resolved recipe (`kiln diff` reads it)
        manifest.json                written last: size and checksum of every other file
      latest                  name of the newest complete checkpoint
      final -> step_0002000   the end of training; never rotated away
      index.json              the kept checkpoints, for humans and tools
      .tmp-step_0003000/      a save in progress (ignored, removed by the next save)

A folder counts as a checkpoint only once its manifest is in place and every listed file has
its recorded size; ``verify`` also checks the checksums before anything is loaded.

Checksums are xxh3-128 (the ``xxhash`` package) since manifest version 2; version 1 manifests
(sha256) are still verified. Why not sha256: a checksum here guards against corruption (a torn
write, a flipped bit, a file swapped in), not against an attacker, who could rewrite the
unsigned manifest as well; sha256 ran at ~1.4 GB/s on the 2-core Intel Xeon dev box (74 MB
checkpoint: 54 ms per save and again per load, a third of a bare ``dcp.save``), xxh3-128 through
``mmap`` at ~8 GB/s (9 ms). See docs/benchmarks.md, "Checkpoints".
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
import time
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import xxhash

from kiln.components.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = "kiln-checkpoint"
FORMAT_VERSION = 2  # 2: xxh3_128 checksums; 1: sha256
READ_VERSIONS = (1, 2)
CHECKSUM = "xxh3_128"
TMP_PREFIX = ".tmp-"
PURGE_PREFIX = f"{TMP_PREFIX}purge-"
_STEP_RE = re.compile(r"^step_(\d{7,})$")


def step_name(step: int) -> str:
    return f"step_{int(step):07d}"


def step_of(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


# --------------------------------------------------------------------------- durable writes
def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str, *, durable: bool = True) -> None:
    """Write, fsync, then rename over ``path``: readers see the old or the new file, whole.
    ``durable=False`` skips both fsyncs (the file and its folder) for files that only help
    humans and tools (``latest``, ``index.json``): still atomic, but a power cut may leave the
    previous version; each fsync costs milliseconds on a busy disk, per save."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_path(path.parent)


def json_text(data: Any) -> str:
    return json.dumps(data, indent=2, allow_nan=False) + "\n"


def write_json(path: Path, data: Any, *, durable: bool = True) -> None:
    write_atomic(path, json_text(data), durable=durable)


def sha256(path: Path) -> str:
    """A version 1 manifest's checksum."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def checksum(path: Path) -> str:
    """xxh3-128 of a file, read through ``mmap``: no copy out of the page cache (twice as fast
    as ``readinto`` a buffer here). Checkpoint files are never truncated in place (a save writes
    a new folder; rotation unlinks), and ``verify`` checks the size first."""
    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
                h.update(view)
    return h.hexdigest()


_CHECKSUMS = {1: ("sha256", sha256), 2: (CHECKSUM, checksum)}


# -------------------------------------------------------------------------------- manifests
def write_manifest(folder: Path, step: int, extra: dict[str, Any] | None = None) -> None:
    """fsync and checksum every file, then write the manifest: the folder's seal. (An fsync
    of a file DCP has synced already costs microseconds; the files kiln writes are plain
    writes, made durable here.)"""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST:
            continue
        fsync_path(path)
        files[rel] = {"size": path.stat().st_size, CHECKSUM: checksum(path)}
    manifest = {"format": FORMAT, "version": FORMAT_VERSION, "step": int(step), "files": files,
                **(extra or {})}
    write_json(folder / MANIFEST, manifest)


def read_manifest(folder: Path) -> dict[str, Any]:
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{folder}: no {MANIFEST} (a save is renamed into place only once its manifest is "
            "written, so the folder was damaged or edited since, or is not a kiln checkpoint); "
            "resume from another checkpoint"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc}); the folder is corrupt") \
            from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or not isinstance(manifest.get("files"), dict) or type(manifest.get("step")) is not int:
        raise CheckpointError(f"{path}: not a kiln checkpoint manifest")
    if manifest.get("version") not in READ_VERSIONS:
        raise CheckpointError(
            f"{path}: checkpoint format version {manifest.get('version')!r}; this kiln reads "
            f"versions {', '.join(map(str, READ_VERSIONS))}. Use the kiln version that wrote it "
            "(see recipe.toml)."
        )
    return manifest


def verify(folder: Path, *, hashes: bool = True) -> dict[str, Any]:
    """Check a checkpoint folder against its manifest; return the manifest.

    Raises CheckpointError naming the first missing, truncated, extra or altered file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: no such checkpoint folder")
    manifest = read_manifest(folder)
    kind, digest = _CHECKSUMS[manifest["version"]]
    listed = manifest["files"]
    present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    present.discard(MANIFEST)
    missing = sorted(set(listed) - present)
    if missing:
        raise CheckpointError(f"{folder}: missing files {missing}; the checkpoint is incomplete")
    extra = sorted(present - set(listed))
    if extra:
        raise CheckpointError(
            f"{folder}: files {extra} are not in the manifest; the folder was modified after the "
            "save. Remove them or resume from another checkpoint."
        )
    for rel, info in listed.items():
        if not isinstance(info, dict) or type(info.get("size")) is not int:
            raise CheckpointError(f"{folder}: manifest entry for {rel} is malformed")
        size = (folder / rel).stat().st_size
        if size != info["size"]:
            raise CheckpointError(
                f"{folder / rel}: {size} bytes, the manifest says {info['size']} (truncated or "
                "overwritten); resume from another checkpoint"
            )
        if hashes and digest(folder / rel) != info.get(kind):
            raise CheckpointError(
                f"{folder / rel}: content does not match its checksum ({kind}) in the manifest "
                "(corrupt or tampered); resume from another checkpoint"
            )
    return manifest


def is_complete(folder: Path) -> bool:
    try:
        verify(folder, hashes=False)
    except (CheckpointError, OSError):
        return False
    return True


# ------------------------------------------------------------------------- the run's folder
def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step_* folder, complete or not, oldest first."""
    if not root.is_dir():
        return []
    out = [(step_of(p.name), p) for p in root.iterdir() if p.is_dir() and not p.is_symlink()]
    return sorted((s, p) for s, p in out if s is not None)


def newest_complete(root: Path, warn: bool = True) -> Path | None:
    """The newest complete checkpoint under ``root``; incomplete ones are skipped with a warning."""
    for step, folder in reversed(list_checkpoints(root)):
        if is_complete(folder):
            return folder
        if warn:
            warnings.warn(f"kiln: ignoring incomplete checkpoint {folder} (step {step}): its save "
                          "did not finish", stacklevel=2)
    return None


def check_no_stray_snapshots(run_dir: Path, root: Path | None, setting: str) -> None:
    """Before a run folder starts fresh: refuse when snapshots lie in it outside ``root``, the
    checkpoint folder (None: checkpoints are off). ``setting``: what differs from when they
    were saved (``checkpoint.folder = 'x'``, ``checkpoint.enable = false``). Such a run started
    over from step 1 without a word, beside its snapshots."""
    if not run_dir.is_dir():
        return
    for folder in sorted(p for p in [run_dir, *run_dir.iterdir()] if p.is_dir()):
        if root is not None and folder.resolve() == root.resolve():
            continue
        found = newest_complete(folder, warn=False)
        if found is None:
            continue
        if root is None:
            what = (f"{setting}, so kiln does not start the run over; set checkpoint.enable = "
                    "true to resume from them")
        else:
            what = (f"{setting} ({root}) holds none, so kiln does not start the run over; set "
                    "checkpoint.folder back to the folder they are in to resume, point "
                    f"checkpoint.resume at {found} to continue from it, or start over on "
                    "purpose with --checkpoint.resume=off (the snapshots are kept)")
        raise CheckpointError(f"{run_dir}: this run has snapshots in {folder} (newest "
                              f"{found.name}), and {what}, or start a new run with another "
                              "--run.folder")


def remove_temporaries(root: Path) -> None:
    for p in root.glob(f"{TMP_PREFIX}*"):
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def publish(tmp: Path, final: Path) -> None:
    """Rename a sealed temporary folder into place (replacing an older save of the same step)."""
    old = None
    if final.exists():
        old = final.with_name(f"{TMP_PREFIX}old-{final.name}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def set_link(root: Path, name: str, target: str) -> None:
    """Point the symlink ``root/name`` at ``target`` atomically (create, then rename over).

    A folder in its place is a copy of the run made by a tool that follows links (Python's
    ``shutil.copytree``, ``cp -L``, many sync tools): the rename over it raised a bare
    IsADirectoryError after the last step. It is moved aside (kept, with a warning)."""
    path = root / name
    if path.is_dir() and not path.is_symlink():
        aside = root / f"{name}.copied-{time.strftime('%Y%m%d-%H%M%S')}"
        os.replace(path, aside)
        warnings.warn(f"kiln: {path} was a folder, not a link (the run folder was copied "
                      f"following links); moved it to {aside.name} and pointed {name} at "
                      f"{target}: delete {aside.name} if it is the same checkpoint",
                      stacklevel=2)
    tmp = root / f"{TMP_PREFIX}{name}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, path)
    fsync_path(root)


def link_target(root: Path, name: str) -> str | None:
    path = root / name
    return os.path.basename(os.readlink(path)) if path.is_symlink() else None


def rotate(root: Path, keep_last: int, keep: Iterable[str] = ()) -> list[str]:
    """Retire all but the newest ``keep_last`` complete checkpoints; ``final``, the latest and
    the names in ``keep`` (snapshots a pending evaluation needs) are always kept. A retired
    folder is renamed to ``.tmp-purge-<name>`` (one atomic rename: it stops counting as a
    checkpoint at once) and deleted by ``purge``, which the manager runs in the background
    (unlinking a checkpoint's files is the slow part). Returns the names."""
    if keep_last <= 0:
        return []
    complete = [p for _, p in list_checkpoints(root) if is_complete(p)]
    protected = {p.name for p in complete[-keep_last:]} | set(keep)
    for name in ("final",):
        target = link_target(root, name)
        if target:
            protected.add(target)
    removed = []
    for p in complete:
        if p.name not in protected:
            aside = root / f"{PURGE_PREFIX}{p.name}"
            shutil.rmtree(aside, ignore_errors=True)  # left by a purge a crash interrupted
            os.replace(p, aside)
            removed.append(p.name)
    if removed:
        fsync_path(root)
    return removed


def purge(root: Path) -> None:
    """Delete the folders ``rotate`` set aside (also ``remove_temporaries``' job at the next
    save, should this one be cut short)."""
    for p in root.glob(f"{PURGE_PREFIX}*"):
        shutil.rmtree(p, ignore_errors=True)


def write_index(root: Path) -> None:
    entries = []
    for step, folder in list_checkpoints(root):
        if not is_complete(folder):
            continue
        manifest = read_manifest(folder)
        entries.append({"name": folder.name, "step": step, "tokens": manifest.get("tokens"),
                        "saved_at": manifest.get("saved_at"), "loss": manifest.get("loss")})
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    write_json(root / "index.json", durable=False, data={
        "format": "kiln-checkpoints",
        "latest": latest,
        "final": link_target(root, "final"),
        "checkpoints": entries,
        "layout": "step_NNNNNNN/ = a complete checkpoint; resume with checkpoint.resume=PATH",
    })

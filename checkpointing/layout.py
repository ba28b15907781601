"""The on-disk layout of a run's checkpoints, and the file operations that keep it consistent.

::

    RUN/checkpoints/
      step_0001000/           one complete checkpoint (immutable once renamed into place)
        .metadata __0_0.distcp ...   DCP: model and optimizer tensors (all ranks)
        rank_00000.safetensors       per rank: RNG, carry; JSON header: payload, loader cursor
        state.json                   progress, world size, non-tensor optimizer/model state
        recipe.toml                  the resolved recipe (`kiln diff` reads it)
        manifest.json                written last: size and sha256 of every other file
      latest                  name of the newest complete checkpoint
      final -> step_0002000   the end of training; never rotated away
      index.json              the kept checkpoints, for humans and tools
      .tmp-step_0003000/      a save in progress (ignored, removed by the next save)

A folder counts as a checkpoint only once its manifest is in place and every listed file has
its recorded size; ``verify`` also checks the hashes before anything is loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from kiln.components.errors import CheckpointError

MANIFEST = "manifest.json"
FORMAT = "kiln-checkpoint"
FORMAT_VERSION = 1
TMP_PREFIX = ".tmp-"
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


def write_atomic(path: Path, text: str) -> None:
    """Write, fsync, then rename over ``path``: readers see the old or the new file, whole."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def write_json(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, allow_nan=False) + "\n")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# -------------------------------------------------------------------------------- manifests
def write_manifest(folder: Path, step: int, extra: dict[str, Any] | None = None) -> None:
    """Hash every file, fsync it, then write the manifest: the folder's seal."""
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST:
            continue
        fsync_path(path)
        files[rel] = {"size": path.stat().st_size, "sha256": sha256(path)}
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
    if manifest.get("version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {manifest.get('version')!r}; this kiln reads "
            f"version {FORMAT_VERSION}. Use the kiln version that wrote it (see recipe.toml)."
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
        if hashes and sha256(folder / rel) != info.get("sha256"):
            raise CheckpointError(
                f"{folder / rel}: content does not match its sha256 in the manifest (corrupt or "
                "tampered); resume from another checkpoint"
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
    """Point the symlink ``root/name`` at ``target`` atomically (create, then rename over)."""
    tmp = root / f"{TMP_PREFIX}{name}.{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, root / name)
    fsync_path(root)


def link_target(root: Path, name: str) -> str | None:
    path = root / name
    return os.path.basename(os.readlink(path)) if path.is_symlink() else None


def rotate(root: Path, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints; ``final`` and the latest are
    always kept. Returns the names removed."""
    if keep_last <= 0:
        return []
    complete = [p for _, p in list_checkpoints(root) if is_complete(p)]
    protected = {p.name for p in complete[-keep_last:]}
    for name in ("final",):
        target = link_target(root, name)
        if target:
            protected.add(target)
    removed = []
    for p in complete:
        if p.name not in protected:
            shutil.rmtree(p)
            removed.append(p.name)
    return removed


def write_index(root: Path) -> None:
    entries = []
    for step, folder in list_checkpoints(root):
        if not is_complete(folder):
            continue
        manifest = read_manifest(folder)
        entries.append({"name": folder.name, "step": step, "tokens": manifest.get("tokens"),
                        "saved_at": manifest.get("saved_at"), "loss": manifest.get("loss")})
    latest = (root / "latest").read_text().strip() if (root / "latest").is_file() else None
    write_json(root / "index.json", {
        "format": "kiln-checkpoints",
        "latest": latest,
        "final": link_target(root, "final"),
        "checkpoints": entries,
        "layout": "step_NNNNNNN/ = a complete checkpoint; resume with checkpoint.resume=PATH",
    })

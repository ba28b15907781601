"""Pickle-free storage: tensors through DCP or safetensors, everything else as JSON.

DCP itself pickles its ``.metadata`` index and would pickle (and fully unpickle, without the
weights-only restriction) any non-tensor value in a state dict. kiln therefore (1) hands DCP only
tensors, splitting every other leaf into a JSON tree, (2) reads the index with an unpickler that
accepts only DCP's own metadata classes, and (3) refuses byte items when loading. Tensor data
inside DCP files is read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import json
import math
import os
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from kiln.components.errors import CheckpointError

_JSON_LEAVES = (type(None), bool, int, float, str)
# DCP warns that it runs "in a single process" even when told to (no_dist=True), also from the
# background thread of an async save, where a catch_warnings() block cannot reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable")


# ------------------------------------------------------------------------ tensor/JSON split
def split_tree(tree: dict[str, Any], where: str = "") -> tuple[dict, dict]:
    """Split a nested state dict into (tensors only, JSON-able rest), same nesting."""
    tensors: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for key, value in tree.items():
        if not isinstance(key, str):
            raise CheckpointError(f"state key {where}{key!r} is not a string; kiln cannot save it")
        path = f"{where}{key}"
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, dict):
            t, r = split_tree(value, path + ".")
            if t:
                tensors[key] = t
            if r or not t:
                rest[key] = r
        else:
            rest[key] = to_json(value, path)
    return tensors, rest


def to_json(value: Any, path: str) -> Any:
    if isinstance(value, _JSON_LEAVES) and not isinstance(value, float):
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CheckpointError(f"state value {path} = {value} is not finite; cannot save it")
        return value
    if isinstance(value, (list, tuple)):
        return [to_json(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {str(k): to_json(v, f"{path}.{k}") for k, v in value.items()}
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # numpy scalar
        return to_json(value.item(), path)
    raise CheckpointError(
        f"state value {path} is a {type(value).__name__}; kiln saves tensors and plain JSON "
        "values only (no pickle). Return tensors or JSON types from state_dict()."
    )


def merge_tree(tensors: dict, rest: dict) -> dict:
    """Inverse of ``split_tree``."""
    out = dict(rest)
    for key, value in tensors.items():
        out[key] = merge_tree(value, rest.get(key, {})) if isinstance(value, dict) else value
    return out


def dumps(data: Any) -> str:
    return json.dumps(data, allow_nan=False, sort_keys=True)


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path,
                     metadata: dict[str, str]) -> None:
    """``safetensors.torch.save_file`` with the file mode every other file gets: its writer
    creates a private (0600) temporary file and renames it into place. Its write errors (a
    full disk) are ``SafetensorError``, not ``OSError``: raised here as ``OSError``, so every
    caller's one-line message for a failed write covers them."""
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        raise OSError(f"{path}: {exc}") from exc
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` sets it, racing threads)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022  # the usual default where /proc is missing


# -------------------------------------------------------------------------- per-rank files
def save_rank_file(path: Path, tensors: dict[str, torch.Tensor], header: dict[str, Any]) -> None:
    tensors = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    save_safetensors(tensors, path, {"kiln": dumps(header)})


def load_rank_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    header = read_rank_header(path)
    try:
        return load_file(str(path)), header
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable rank state ({exc}); the file is corrupt") \
            from exc


def read_rank_header(path: Path) -> dict[str, Any]:
    """The JSON header of a rank file, without reading its tensors."""
    from safetensors import safe_open

    if not path.is_file():
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        header = json.loads(meta["kiln"])
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable rank state ({exc}); the file is corrupt") \
            from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: rank state header is not a JSON object")
    return header


# ------------------------------------------------------------------ DCP without unpickling
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "MetadataIndex", "StorageMeta", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Accepts only the classes DCP's index is made of (and torch dtypes)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise CheckpointError(
            f"DCP index refers to {module}.{name}, which a DCP index never contains; the "
            "checkpoint was tampered with. Refusing to load it."
        )


class SafeReader(FileSystemReader):
    """A FileSystemReader whose ``.metadata`` is read with the allow-list unpickler, once:
    ``load_tensors`` reads it first (a bad index fails with kiln's message, outside DCP's
    wrapping) and ``dcp.load`` asks for it again."""

    _metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any):
        if self._metadata is None:
            self._metadata = self._read_metadata(kwargs.get("rank"))
        self._metadata.storage_meta.load_id = self.load_id  # dcp.load resets the reader
        return self._metadata

    def _read_metadata(self, rank: int | None):
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            data = f.read()
        try:
            metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        except CheckpointError:
            raise
        except Exception as exc:  # truncated/garbled pickle raises many different types
            raise CheckpointError(f"{path}: unreadable DCP index ({exc}); the file is corrupt") \
                from exc
        from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: not a DCP index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        return metadata


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """kiln writes tensors only; a byte item would be unpickled, so it is refused."""

    def __init__(self) -> None:
        super().__init__(allow_partial_load=False)

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(
            f"DCP item {read_item.dest_index.fqn} is pickled bytes; kiln never writes those, so "
            "the checkpoint was not written by kiln or was tampered with"
        )


def quiet_dcp() -> None:
    """DCP warns that it runs "in a single process" whenever it does, even when asked to
    (``no_dist=True``), and an async save warns from DCP's own thread after the call returned,
    so a scoped filter cannot catch it: ignore that one message for the process (called before
    every DCP call, so it also holds where a test harness resets the filters)."""
    warnings.filterwarnings(
        "ignore", message="torch.distributed is disabled, unavailable or uninitialized",
        category=UserWarning,
    )


def load_tensors(tensors: dict, folder: Path, *, no_dist: bool, hint: str = "") -> None:
    """``dcp.load`` into ``tensors`` in place, pickle-free; every failure is a CheckpointError.

    DCP wraps errors in ``CheckpointException`` (a BaseException) per rank; kiln's own errors
    are unwrapped so their message reaches the user, anything else gets ``hint`` appended.
    """
    reader = SafeReader(str(folder))
    try:  # a bad index fails here, with kiln's message
        reader.read_metadata()
    except OSError as exc:
        raise CheckpointError(f"{folder}: no readable DCP index ({exc})") from exc
    try:
        quiet_dcp()
        dcp.load(tensors, storage_reader=reader,
                 planner=TensorOnlyLoadPlanner(), no_dist=no_dist)
    except CheckpointException as exc:
        failures = [e for e, _ in exc.failures.values()]
        for e in failures:
            if isinstance(e, CheckpointError):
                raise CheckpointError(str(e)) from None
        first = failures[0] if failures else exc
        raise CheckpointError(f"{folder}: {_short(first)}{hint}") from None
    except CheckpointError:
        raise
    except Exception as exc:  # missing keys / shape mismatches surface as several types
        raise CheckpointError(f"{folder}: {_short(exc)}{hint}") from exc


def _short(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit] + " ..."

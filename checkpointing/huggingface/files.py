"""Safetensors folders in Hugging Face's layout: read slices of one or many files (with
``model.safetensors.index.json``), write sharded files with an index, ranks in parallel.

Reading goes through ``safe_open(...).get_slice``, so a rank that owns rows [a, b) of a matrix
reads those rows only: a model never has to exist whole on one rank. Writing takes one full
tensor at a time (a DTensor is gathered with ``full_tensor()``, every rank in the same order);
the files are planned from the shapes alone, so every rank knows which rank writes which file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch.distributed.tensor import DTensor

from kiln.checkpointing.huggingface import fp8, mxfp4
from kiln.checkpointing.huggingface.parts import Part, from_hf, hf_shapes, to_hf
from kiln.checkpointing.storage import save_safetensors
from kiln.components.errors import CheckpointError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


class SafetensorsFolder:
    """The tensors of a Hugging Face checkpoint folder, read lazily by slice."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._open: dict[str, object] = {}
        self._stored: dict[str, str] = {}  # name asked for -> name in the file (add_prefix)
        self.fp8_block: tuple[int, int] | None = None  # block-scaled FP8 weights: dequantize
        self._mxfp4: dict[str, tuple[str, str]] = {}  # matrix -> its MXFP4 blocks and scales
        index = self.folder / INDEX
        if index.is_file():
            try:
                self.weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"{index}: not a safetensors index ({exc})") from None
        else:
            files = sorted(p.name for p in self.folder.glob("*.safetensors"))
            if not files:
                pickled = sorted(p.name for p in self.folder.glob("*.bin"))
                hint = (f" (it holds {', '.join(pickled)}: pickle files, which kiln never loads; "
                        "convert them to safetensors)") if pickled else ""
                raise CheckpointError(f"{self.folder}: no *.safetensors weights{hint}")
            # a safe_open handle is not a dict: keys() is its API
            self.weight_map = {name: f for f in files
                               for name in self._handle(f).keys()}  # noqa: SIM118
        for file in sorted(set(self.weight_map.values())):
            if not (self.folder / file).is_file():
                raise CheckpointError(f"{index}: names {file}, which is missing from "
                                      f"{self.folder}")

    def _handle(self, file: str):
        if file not in self._open:
            try:
                self._open[file] = safe_open(str(self.folder / file), framework="pt")
            except (SafetensorError, OSError) as exc:
                raise CheckpointError(f"{self.folder / file}: cannot read safetensors "
                                      f"({exc})") from None
        return self._open[file]

    def add_prefix(self, prefix: str, keep: tuple[str, ...] = ()) -> None:
        """Where no stored name starts with ``prefix``, answer to every name with it (those
        starting with ``keep`` stay as stored): checkpoints saved from a base model (GPT-2's
        ``h.0.attn...``) read as their language model's (``transformer.h.0.attn...``)."""
        if any(name.startswith(prefix) for name in self.weight_map):
            return
        renamed = {name if name.startswith(keep) else prefix + name: name
                   for name in self.weight_map}
        self.weight_map = {new: self.weight_map[old] for new, old in renamed.items()}
        self._stored = renamed

    def enable_mxfp4(self) -> None:
        """Answer to each MXFP4 pair (``NAME_blocks``, ``NAME_scales``) as the matrix ``NAME``,
        dequantized when read (``mxfp4``)."""
        self._mxfp4 = mxfp4.packed(set(self.weight_map))

    def keys(self) -> set[str]:
        pairs = {n for names in self._mxfp4.values() for n in names}
        return (set(self.weight_map) - pairs) | set(self._mxfp4)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._mxfp4:
            return mxfp4.shape(self.shape(self._mxfp4[name][0]))
        stored = self._stored.get(name, name)
        return tuple(self._handle(self.weight_map[name]).get_slice(stored).get_shape())

    def read(self, name: str, index: tuple[slice, ...] = ()) -> torch.Tensor:
        """``tensor[index]`` of one stored tensor, reading only those bytes; a block-scaled
        FP8 matrix (``fp8_block`` set) or an MXFP4 one (``enable_mxfp4``) comes back
        dequantized, float32."""
        if name in self._mxfp4:
            return mxfp4.read(self.read, self._mxfp4[name], self.shape(name), index)
        stored = self._stored.get(name, name)
        piece = self._handle(self.weight_map[name]).get_slice(stored)
        data = piece[index] if index else piece[:]
        scales = fp8.scale_name(name)
        if self.fp8_block and data.dtype in fp8.FP8 and scales in self.weight_map:
            return fp8.dequantize(data, index, tuple(piece.get_shape()), self.fp8_block,
                                  lambda at: self.read(scales, at))
        return data

    def read_rows(self, parts: list[Part], offset: tuple[int, ...],
                  shape: tuple[int, ...]) -> torch.Tensor:
        """The region ``[offset, offset + shape)`` of the kiln tensor stacked from ``parts``
        (kiln's RoPE row order), reading only the rows it needs (whole heads where permuted)."""
        if not shape:
            return self.read(parts[0].hf_name)
        a, n = offset[0], shape[0]
        cols = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))
        pieces, row0 = [], 0
        for part in parts:
            lo, hi = max(a, row0) - row0, min(a + n, row0 + part.rows) - row0
            if lo < hi:
                s = part.start
                if part.transposed and len(cols) == 2:  # one (A, B) matrix stored as (B, A)
                    pieces.append(self.read(part.hf_name, (cols[1], cols[0])).t()[None])
                elif part.transposed:  # the rows are the stored tensor's columns
                    pieces.append(self.read(part.hf_name, (*cols, slice(s + lo, s + hi))).t())
                elif part.heads:
                    d = part.rows // part.heads
                    h0, h1 = lo // d, (hi - 1) // d + 1
                    block = self.read(part.hf_name, (slice(s + h0 * d, s + h1 * d), *cols))
                    pieces.append(from_hf(block, h1 - h0, part.rope_dim)[lo - h0 * d:hi - h0 * d])
                else:
                    pieces.append(self.read(part.hf_name, (slice(s + lo, s + hi), *cols)))
                if part.offset:
                    pieces[-1] = pieces[-1].float() + part.offset
            row0 += part.rows
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0]


def parse_size(text: str | int) -> int:
    """Bytes of "5GB", "500MB", "10KB" or a plain number (Hugging Face's max_shard_size)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]i?B|B)?\s*", text, flags=re.IGNORECASE)
    if not m:
        raise CheckpointError(f"shard size {text!r}: write e.g. 5GB, 500MB or a byte count")
    unit = (m.group(2) or "B").upper()
    scale = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}[unit]
    return int(float(m.group(1)) * scale)


def _entries(items, dtype) -> list[tuple[str, tuple[int, ...], int]]:
    """(Hugging Face name, shape, bytes) of every tensor to write, in order."""
    size = {p.hf_name: torch.empty((), dtype=dtype or t.dtype).element_size()
            for t, parts in items for p in parts}
    shapes = hf_shapes((tuple(t.shape), parts) for t, parts in items)
    return [(name, shape, size[name] * int(torch.Size(shape).numel()))
            for name, shape in shapes.items()]


def plan_files(entries, max_bytes: int) -> list[list[str]]:
    """Consecutive tensors packed into files of at most ``max_bytes`` (a bigger tensor alone)."""
    files: list[list[str]] = [[]]
    used = 0
    for name, _, nbytes in entries:
        if files[-1] and used + nbytes > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += nbytes
    return files


def weight_files(folder: Path) -> list[Path]:
    """The weight files and index an export writes (``model.safetensors``, its shards
    ``model-NNNNN-of-NNNNN.safetensors`` and the index) found in ``folder``."""
    shard = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
    return sorted(p for p in Path(folder).iterdir() if p.is_file() and (
        p.name in (SINGLE, INDEX) or shard.fullmatch(p.name)))


def write_sharded(items: Iterable[tuple[torch.Tensor, list[Part]]], folder: Path, *,
                  max_bytes: int, rank: int = 0, world_size: int = 1,
                  dtype: torch.dtype | None = None) -> dict:
    """Write kiln tensors (each split into its Hugging Face ``parts``) to ``folder``; file i is
    written by rank ``i % world_size``. Every rank must call this with the same items (DTensors
    are gathered collectively). Returns the index (also for a single file, which is then named
    model.safetensors and needs no index file)."""
    items = list(items)
    entries = _entries(items, dtype)
    files = plan_files(entries, max_bytes)
    n = len(files)
    names = [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                                     for i in range(n)]
    file_of = {name: i for i, group in enumerate(files) for name in group}
    pending: dict[int, dict[str, torch.Tensor]] = {}
    # the parts each Hugging Face tensor waits for (several kiln tensors may hold them)
    waiting = {p.hf_name: 0 for _, parts in items for p in parts}
    for _, parts in items:
        for p in parts:
            waiting[p.hf_name] += 1
    pieces: dict[str, list[tuple[int, torch.Tensor, bool]]] = {}
    for tensor, parts in items:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        mine = [p for p in parts if file_of[p.hf_name] % world_size == rank]
        if not mine:
            continue
        full = full.detach().to("cpu", dtype=dtype or full.dtype)
        row0 = 0
        for part in parts:
            if part in mine:
                rows = full if not full.dim() else full[row0:row0 + part.rows]
                if part.transposed:  # a matrix of a stack (one row) or a 2-D weight
                    piece = rows[0].t() if rows.dim() == 3 else rows.t()
                else:
                    piece = to_hf(rows, part.heads, part.rope_dim)
                if part.offset:
                    piece = (piece.float() - part.offset).to(piece.dtype)
                pieces.setdefault(part.hf_name, []).append((part.start, piece, part.transposed))
            row0 += part.rows
        for name in {p.hf_name for p in mine}:  # complete: one tensor from its parts, by start
            got = pieces[name]
            if len(got) < waiting[name]:
                continue
            got = sorted(pieces.pop(name), key=lambda piece: piece[0])
            axis = 1 if got[0][2] else 0
            whole = (torch.cat([t for _, t, _ in got], dim=axis) if len(got) > 1  # new tensor
                     else got[0][1].contiguous().clone())
            pending.setdefault(file_of[name], {})[name] = whole
        for i in [i for i, got in pending.items() if len(got) == len(files[i])]:
            save_safetensors(pending.pop(i), folder / names[i], {"format": "pt"})
    if pending:
        raise CheckpointError(f"export: tensors missing from {sorted(pending)}")
    return {"metadata": {"total_size": sum(e[2] for e in entries)},
            "weight_map": {name: names[file_of[name]] for name, _, _ in entries}}

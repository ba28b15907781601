"""The packed-document dataset folder (layout version 1): writing, opening and validating it.

    metadata.json          layout version, vocab, counts (tokens, documents, UTF-8 bytes per
                           split), the largest token id (max_id), seed (the epochs' order),
                           split_seed (the held-out draw), tokenizer fingerprint
                           and source, source (written last)
    tokens.bin             every document as [BOS] + ids + [EOS], back to back (uint16/uint32)
    doc_offsets.npy        int64 (num_docs + 1,): start of each document, then total_tokens
    epoch_N/doc_start.npy  int64 (num_train_docs,): the train documents in data epoch N's order
    epoch_N/doc_len.npy    int64 (num_train_docs,): their lengths (BOS and EOS included)
    eval/doc_start.npy     the held-out documents (never in a train epoch), in a seeded order
    eval/doc_len.npy

The folder is built under a temporary name and renamed into place, so a crash never leaves a
folder at the real path that looks valid. Opening it checks everything that is cheap to check
(no pass over the tokens: the recorded max_id stands for them, and the loader checks the ids of
every batch it reads, which also covers folders written before max_id was recorded) and names the
folder and the fix in every error; ``check_ids`` reads every token (`kiln data info`).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import xxhash

from kiln.components.caching import file_lock  # noqa: F401 - kept importable here
from kiln.components.data.prepare import splits
from kiln.components.errors import DataError

LAYOUT_VERSION = 1
META, TOKENS, OFFSETS = "metadata.json", "tokens.bin", "doc_offsets.npy"
SCAN_CHUNK = 1 << 24  # tokens per read when scanning tokens.bin for its ids
_REQUIRED = ("layout_version", "vocab_size", "token_dtype", "total_tokens", "num_docs",
             "num_epochs", "seed", "bos_id", "eos_id", "tokenizer", "splits")


class Tokenizer(Protocol):
    bos_id: int
    eos_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...
    def fingerprint(self) -> str: ...


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def _rng(seed: int, stream: int, epoch: int = 0) -> np.random.Generator:
    """Independent streams per (seed, purpose, epoch): epoch 1 of seed 0 never equals epoch 0
    of seed 1, as it would with ``seed + epoch``."""
    return np.random.default_rng([seed % (1 << 64), stream, epoch])


def split_documents(num_docs: int, eval_fraction: float, seed: int) -> tuple[np.ndarray, ...]:
    """(train ids, eval ids): eval is a seeded random ``eval_fraction`` of the documents, at
    least one when the fraction is > 0, never all of them; eval keeps its shuffled order so
    that an evaluation cut short by a token budget still sees a random sample."""
    ones = np.ones(num_docs, dtype=np.int64)
    got = splits.split(ones, ones, eval_split="random", eval_fraction=eval_fraction, seed=seed)
    return got.train, got.eval


def document_tokens(ids: np.ndarray, lengths: np.ndarray, bos: int, eos: int) -> np.ndarray:
    """Documents as ``[BOS] + ids + [EOS]`` back to back, from their bare ids concatenated."""
    return splits.frame(ids, lengths, bos, eos, "bos_eos")


def write_layout(folder: str | Path, texts: Iterable[str], tokenizer: Tokenizer, *,
                 seq_len: int, num_epochs: int, seed: int, eval_fraction: float,
                 source: str, extra: dict[str, Any] | None = None,
                 batch_docs: int = 256, split_seed: int | None = None) -> Path:
    """Tokenize ``texts`` (one document each, ``batch_docs`` per ``encode_batch``) in this
    process into a new layout folder at ``folder``; ``prepare.py`` is the parallel, resumable
    builder for large corpora. ``seed`` orders the epochs; ``split_seed`` (default: ``seed``)
    draws the held-out documents.

    If another process finished the same folder first, its copy is kept and ours discarded.
    """
    from kiln.components.data.prepare.encode_pool import encode

    folder = Path(folder)
    if folder.exists():
        raise DataError(f"{folder} already exists; delete it or choose another output folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    dtype = token_dtype(tokenizer.vocab_size)
    lengths, nbytes = [], []
    try:
        with open(tmp / TOKENS, "wb") as f:
            for batch in _batched(texts, batch_docs):
                enc = encode(tokenizer, batch, dtype)
                f.write(document_tokens(enc.ids, enc.lengths, tokenizer.bos_id,
                                        tokenizer.eos_id).tobytes())
                lengths.append(enc.lengths + 2)
                nbytes.append(enc.nbytes)
            f.flush()
            os.fsync(f.fileno())
        finish_layout(tmp, np.concatenate(lengths) if lengths else np.empty(0, np.int64),
                      np.concatenate(nbytes) if nbytes else np.empty(0, np.int64),
                      tokenizer_meta(tokenizer), seq_len=seq_len, num_epochs=num_epochs,
                      seed=seed, eval_fraction=eval_fraction, source=source, extra=extra or {},
                      split_seed=split_seed)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / META).is_file():  # not a concurrent builder's finished copy
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _batched(texts: Iterable[str], n: int) -> Iterable[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def tokenizer_meta(tok: Tokenizer) -> dict[str, Any]:
    """What a layout records about its tokenizer (and checks at train time)."""
    return {"vocab_size": tok.vocab_size, "bos_id": tok.bos_id, "eos_id": tok.eos_id,
            "tokenizer": tok.fingerprint(),
            "tokenizer_source": str(getattr(tok, "source", "") or type(tok).__name__)}


def _save(path: Path, array: np.ndarray) -> None:
    path.parent.mkdir(exist_ok=True)
    np.save(path, np.ascontiguousarray(array, dtype=np.int64), allow_pickle=False)


def finish_layout(tmp: Path, lengths: np.ndarray, nbytes: np.ndarray, tok_meta: dict[str, Any],
                  *, seq_len: int, num_epochs: int, seed: int, eval_fraction: float,
                  source: str, extra: dict[str, Any], separator: str = "bos_eos",
                  eval_split: str = "random", eval_docs: int = 0,
                  split_seed: int | None = None) -> dict[str, Any]:
    """Write offsets, the epoch orders, the eval split and metadata.json (last) beside a
    complete tokens.bin; ``lengths`` are per document with its BOS / EOS (``separator``),
    ``nbytes`` its text's UTF-8 bytes (for bits per byte); ``eval_split`` and ``eval_docs``:
    ``splits.split``; ``split_seed`` (default: ``seed``) draws a random split."""
    if len(lengths) < 1:
        raise DataError(f"the source ({source}) gave no documents; check the source and max_bytes")
    split_seed = seed if split_seed is None else split_seed
    cut = splits.split(lengths, nbytes, eval_split=eval_split, eval_fraction=eval_fraction,
                       seed=split_seed, eval_docs=eval_docs)
    lengths, nbytes, train, held_out = cut.lengths, cut.nbytes, cut.train, cut.eval
    num_docs = len(lengths)
    dtype = token_dtype(tok_meta["vocab_size"])
    doc_offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.memmap(tmp / TOKENS, dtype=dtype, mode="r", shape=(int(doc_offsets[-1]),))
    max_id = check_ids(tmp, tokens, tok_meta["vocab_size"],
                       "the tokenizer gave ids beyond its own vocab_size")
    _save(tmp / OFFSETS, doc_offsets)
    for epoch in range(num_epochs):
        order = _rng(seed, 1, epoch).permutation(train)
        _save(tmp / f"epoch_{epoch}" / "doc_start.npy", doc_offsets[order])
        _save(tmp / f"epoch_{epoch}" / "doc_len.npy", lengths[order])
    _save(tmp / "eval" / "doc_start.npy", doc_offsets[held_out])
    _save(tmp / "eval" / "doc_len.npy", lengths[held_out])
    meta = {
        "layout_version": LAYOUT_VERSION, **tok_meta, "token_dtype": dtype.name,
        "total_tokens": int(doc_offsets[-1]), "max_id": max_id, "num_docs": num_docs,
        # what a run's data fingerprint is made of (a resume refuses changed data)
        "tokens_xxh3": xxhash.xxh3_128_hexdigest(np.ascontiguousarray(tokens).view(np.uint8)),
        "seq_len": seq_len,
        "num_epochs": num_epochs, "seed": seed, "split_seed": split_seed,
        "eval_fraction": eval_fraction,
        "source": source, "separator": separator, "eval_split": eval_split,
        "cut_doc": cut.cut,
        "splits": {name: {"docs": len(ids), "tokens": int(lengths[ids].sum()),
                          "bytes": int(nbytes[ids].sum())}
                   for name, ids in (("train", train), ("eval", held_out))},
        **extra,
    }
    part = tmp / (META + ".part")
    part.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(part, tmp / META)  # last: a folder without metadata.json is never valid
    return meta


@dataclass
class PackedLayout:
    """An opened, validated layout folder; ``tokens`` is a read-only memmap."""

    folder: Path
    meta: dict[str, Any]
    tokens: np.ndarray  # (total_tokens,) uint16 | uint32
    doc_offsets: np.ndarray  # (num_docs + 1,) int64

    @property
    def num_epochs(self) -> int:
        return int(self.meta["num_epochs"])

    def order(self, split: str, epoch: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(doc_start, doc_len) of ``split`` ("train": data epoch ``epoch`` modulo the epochs
        written; "eval": the held-out documents)."""
        sub = self.folder / ("eval" if split == "eval" else f"epoch_{epoch % self.num_epochs}")
        return _load(self.folder, sub / "doc_start.npy"), _load(self.folder, sub / "doc_len.npy")


def _bad(folder: Path, what: str) -> DataError:
    return DataError(
        f"dataset folder {folder} is not a valid packed-document layout v{LAYOUT_VERSION}: "
        f"{what}; delete it and rerun `kiln data prepare` (or the training run that built it)"
    )


def _load(folder: Path, path: Path) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise _bad(folder, f"{path.relative_to(folder)} is missing") from None
    except (ValueError, OSError, EOFError) as exc:
        raise _bad(folder, f"{path.relative_to(folder)} is unreadable ({exc})") from None


def id_error(folder: Path, value: int, offset: int, vocab: int, why: str) -> DataError:
    """A token id ``value`` at ``offset`` of tokens.bin that the vocabulary does not have."""
    return DataError(
        f"dataset folder {folder}: token id {value} (token {offset:,} of {TOKENS}) is beyond "
        f"the vocabulary ({vocab} ids); {why}"
    )


def scan_ids(tokens: np.ndarray, vocab: int) -> tuple[int, int | None]:
    """(largest id, offset of the first id outside [0, vocab) or None), reading ``tokens`` (a
    memmap, any integer dtype) in chunks so memory stays small."""
    largest = -1
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = np.asarray(tokens[start:start + SCAN_CHUNK]).ravel()
        if chunk.size and (chunk.max() >= vocab or chunk.min() < 0):
            return largest, start + int(np.argmax((chunk >= vocab) | (chunk < 0)))
        largest = max(largest, int(chunk.max()) if chunk.size else -1)
    return largest, None


def check_ids(folder: Path, tokens: np.ndarray, vocab: int, why: str) -> int:
    """Read every token of a layout's tokens.bin; the largest id, or ``id_error``."""
    largest, bad = scan_ids(tokens, vocab)
    if bad is not None:
        raise id_error(folder, int(tokens[bad]), bad, vocab, why)
    return largest


DAMAGED = ("the file is damaged or was written with another tokenizer: delete the folder and "
           "rerun `kiln data prepare`")


def fingerprint(meta: dict[str, Any]) -> str:
    """What the data of a layout is, for a resume to check it reads the same: the tokens'
    checksum and what orders them (seed, epochs, eval split); not where the folder or its
    source lives, so a run moves between machines. Folders written before the checksum was
    recorded: their counts instead."""
    keys = ("tokens_xxh3", "total_tokens", "num_docs", "seed", "num_epochs", "eval_fraction",
            "tokenizer", "vocab_size")
    what = {k: meta.get(k) for k in keys}
    if meta.get("split_seed", meta.get("seed")) != meta.get("seed"):
        what["split_seed"] = meta["split_seed"]  # (absent otherwise: older folders keep theirs)
    return xxhash.xxh3_64_hexdigest(json.dumps(what, sort_keys=True).encode())


def eval_fingerprint(meta: dict[str, Any]) -> str:
    """What the held-out documents are, and in which order: equal for two folders of the same
    tokens and split whatever orders their train epochs (``seed``), so runs of several training
    seeds are scored on the same data (``kiln compare``)."""
    keys = ("tokens_xxh3", "total_tokens", "num_docs", "eval_fraction", "eval_split", "cut_doc",
            "tokenizer", "vocab_size")
    what = {k: meta.get(k) for k in keys}
    what["eval"] = meta.get("splits", {}).get("eval")
    if meta.get("eval_split", "random") == "random":
        what["split_seed"] = meta.get("split_seed", meta.get("seed"))
    return xxhash.xxh3_64_hexdigest(json.dumps(what, sort_keys=True).encode())


def open_layout(folder: str | Path, tokenizer: Tokenizer | None = None) -> PackedLayout:
    """Open and validate ``folder``; with ``tokenizer``, also check it matches the data."""
    folder = Path(folder)
    if folder.is_file():
        raise DataError(f"dataset folder {folder} is a file, not a prepared dataset folder; "
                        f"build one from it with `kiln data prepare --input {folder} --out "
                        "FOLDER` and point the path at FOLDER")
    if not folder.is_dir():
        raise DataError(f"dataset folder {folder} does not exist; build it from your text with "
                        f"`kiln data prepare --input FILE_OR_FOLDER... --out {folder}`")
    try:
        meta = json.loads((folder / META).read_text())
    except FileNotFoundError:
        if not any((folder / name).exists() for name in (TOKENS, OFFSETS)):
            # not a kiln dataset at all (e.g. the user's text): never advise deleting it
            raise DataError(
                f"dataset folder {folder} holds no prepared dataset (no {META}, {TOKENS} or "
                f"{OFFSETS}): the path names a folder `kiln data prepare` wrote; if {folder} "
                f"holds your text, build one from it with `kiln data prepare --input {folder} "
                "--out FOLDER` and point the path at FOLDER") from None
        raise _bad(folder, f"{META} is missing (an interrupted build?)") from None
    except (ValueError, OSError) as exc:
        raise _bad(folder, f"{META} is unreadable ({exc})") from None
    missing = [k for k in _REQUIRED if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise _bad(folder, f"{META} lacks {', '.join(missing)}")
    if meta["layout_version"] != LAYOUT_VERSION:
        raise _bad(folder, f"layout_version is {meta['layout_version']!r}, this kiln reads "
                           f"{LAYOUT_VERSION}")
    if tokenizer is not None:
        _check_tokenizer(folder, meta, tokenizer)
    max_id = meta.get("max_id", -1)  # absent in folders written before it was recorded
    if not isinstance(max_id, int) or max_id >= meta["vocab_size"]:
        raise _bad(folder, f"{META} records token ids up to {max_id!r}, beyond the vocabulary "
                           f"of {meta['vocab_size']} ids")
    dtype = np.dtype(meta["token_dtype"])
    total = int(meta["total_tokens"])
    size = (folder / TOKENS).stat().st_size if (folder / TOKENS).is_file() else None
    if size != total * dtype.itemsize:
        found = "missing" if size is None else f"{size} bytes"
        raise _bad(folder, f"{TOKENS} is {found}, expected {total} {dtype.name} tokens "
                           f"({total * dtype.itemsize} bytes)")
    tokens = np.memmap(folder / TOKENS, dtype=dtype, mode="r", shape=(total,))
    offsets = _load(folder, folder / OFFSETS)
    if (offsets.shape != (meta["num_docs"] + 1,) or offsets[0] != 0 or offsets[-1] != total
            or np.any(np.diff(offsets) < 1)):
        raise _bad(folder, f"{OFFSETS} does not describe {meta['num_docs']} documents "
                           f"covering {total} tokens")
    _check_framing(folder, meta, tokens, offsets)
    layout = PackedLayout(folder, meta, tokens, offsets)
    _check_orders(layout)
    return layout


def _check_framing(folder: Path, meta: dict[str, Any], tokens: np.ndarray,
                   offsets: np.ndarray) -> None:
    """Documents start with BOS and end with EOS as ``separator`` says (folders written before
    it was recorded: both); the two pieces of a document a tail split cut are exempt."""
    separator = meta.get("separator", "bos_eos")
    try:
        before, after = splits.framing(separator)
    except DataError as exc:
        raise _bad(folder, str(exc)) from None
    starts, ends = offsets[:-1].copy(), offsets[1:] - 1
    keep = np.ones(len(starts), dtype=bool)
    cut = meta.get("cut_doc", -1)
    if isinstance(cut, int) and 0 < cut < len(starts):
        keep[cut] = False  # its start and its head's end are inside one document
    bad_start = before and np.any(tokens[starts[keep]] != meta["bos_id"])
    bad_end = after and np.any(tokens[ends[np.roll(keep, -1)]] != meta["eos_id"])
    if bad_start or bad_end:
        raise _bad(folder, f"documents in {TOKENS} are not framed as separator = {separator!r} "
                           "says (BOS first, EOS last)")


def _check_tokenizer(folder: Path, meta: dict[str, Any], tok: Tokenizer) -> None:
    if meta["vocab_size"] != tok.vocab_size or meta["tokenizer"] != tok.fingerprint():
        ours = tokenizer_meta(tok)["tokenizer_source"]
        theirs = meta.get("tokenizer_source", "?")
        raise DataError(
            f"dataset folder {folder} was tokenized by {theirs} ({meta['tokenizer']}, vocab "
            f"{meta['vocab_size']}), but the recipe's tokenizer is {ours} ({tok.fingerprint()}, "
            f"vocab {tok.vocab_size}); set [tokenizer] to the one the data was built with, "
            "point data.path at a folder built with this tokenizer, or rerun `kiln data prepare`"
        )


def _check_orders(layout: PackedLayout) -> None:
    """Every order names whole documents; train epochs permute the same set; eval is the rest."""
    folder, offsets, meta = layout.folder, layout.doc_offsets, layout.meta
    seen: dict[str, np.ndarray] = {}
    for split, epoch in [("eval", 0)] + [("train", e) for e in range(layout.num_epochs)]:
        name = "eval" if split == "eval" else f"epoch_{epoch}"
        start, length = layout.order(split, epoch)
        count = meta["splits"][split]["docs"]
        if start.shape != (count,) or length.shape != (count,):
            raise _bad(folder, f"{name}/doc_start.npy and doc_len.npy must hold {count} entries")
        idx = np.searchsorted(offsets, start).clip(0, len(offsets) - 2)
        if np.any(offsets[idx] != start) or np.any(offsets[idx + 1] - start != length):
            raise _bad(folder, f"{name} holds (doc_start, doc_len) pairs that are not documents")
        key = np.sort(idx)
        if split == "train" and "train" in seen and not np.array_equal(seen["train"], key):
            raise _bad(folder, f"{name} does not hold the same documents as epoch_0")
        seen.setdefault(split, key)
    everything = np.concatenate([seen["eval"], seen.get("train", seen["eval"][:0])])
    if np.unique(everything).size != meta["num_docs"] or everything.size != meta["num_docs"]:
        raise _bad(folder, "the eval documents overlap the train documents or some are missing")

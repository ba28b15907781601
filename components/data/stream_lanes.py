"""The machinery of ``streaming_text``: documents read in order, dealt to lanes, tokenised on
the fly, cut into windows; every position a few integers.

Train document ``j`` (the inputs in order, again and again, without each pass's first
``eval_docs`` documents) belongs to lane ``j % global_batch``. A lane's token stream is its
documents as ``[BOS] ids [EOS]`` back to back; its window ``k`` is tokens ``[k*L, k*L + L + 1)``.
Row ``i`` of global step ``g`` is window ``g`` of lane ``i``, so the global batch does not depend
on the world size; rank ``r`` and its loader workers take the rows of their micro-batches, and
each reader tokenises only the documents of its own lanes.

A lane's position is the document holding its next window's first token (train index, and
where it starts in the inputs: pass, file, document index, byte offset) plus the token offset in
it. Resuming re-reads from the earliest such place of the lanes (plain JSONL, parquet and Arrow
seek there; compressed JSONL decompresses up to it) and re-tokenises only those documents.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import numpy as np

from kiln.components.data import documents
from kiln.components.errors import DataError
from kiln.components.sources.text_sources import ReadStats, SourceFile, read_documents

Address = list[int]  # [pass, file, document index, byte offset, documents before in the pass]


class DocReader:
    """Train documents ``(j, address, text)`` from an address onwards, pass after pass."""

    def __init__(self, files: list[SourceFile], opts: dict[str, Any], eval_docs: int) -> None:
        self.files, self.opts, self.eval_docs = files, opts, eval_docs
        self.stats = ReadStats()

    def read(self, j: int, address: Address | None) -> Iterator[tuple[int, Address, str]]:
        p, f, index, offset, q = address if address is not None else (0, 0, 0, 0, 0)
        while True:
            found = False
            for fi in range(f, len(self.files)):
                start, off = (index, offset) if fi == f else (0, 0)
                for after, after_off, text in read_documents(
                        self.files[fi], start=start, offset=off, stats=self.stats, **self.opts):
                    here = [p, fi, start, off, q]
                    start, off, q = after, after_off, q + 1
                    if here[4] < self.eval_docs:
                        continue
                    found = True
                    yield j, here, text
                    j += 1
            if not found and (address is None or p > address[0]):
                raise DataError(f"data.inputs hold no training documents after the first "
                                f"data.eval_docs = {self.eval_docs}{skipped(self.stats)}; add "
                                "data or lower data.eval_docs")
            p, f, index, offset, q = p + 1, 0, 0, 0, 0


def skipped(stats: ReadStats) -> str:
    """What reading passed over, for a message about missing documents ("" if nothing)."""
    parts = [f"{n} {what}" for n, what in ((stats.invalid_utf8, "not UTF-8 (skipped: "
                                            "data.on_invalid_utf8 = 'skip')"),
                                           (stats.empty, "empty")) if n]
    return f" ({' and '.join(parts)}: first at {stats.where[0]})" if parts else ""


def eval_texts(files: list[SourceFile], opts: dict[str, Any], n: int,
               stats: ReadStats | None = None) -> list[str]:
    """The first ``n`` documents of the inputs: the held-out eval split (``stats``: what reading
    skipped on the way)."""
    out: list[str] = []
    for src in files:
        for _, _, text in read_documents(src, stats=stats, **opts):
            if len(out) == n:
                return out
            out.append(text)
    return out


class Lanes:
    """One reader's lanes: windows of ``seq_len + 1`` tokens, tokenised in batches."""

    def __init__(self, lanes: list[int], global_batch: int, seq_len: int, reader: DocReader,
                 tokenizer: Any, batch_docs: int, state: dict[str, Any] | None) -> None:
        self.lanes, self.gb, self.seq_len = lanes, global_batch, seq_len
        self.reader, self.tok, self.batch_docs = reader, tokenizer, batch_docs
        self.dtype = np.int64
        # per lane: deque of [j, address, tokens]; the first holds the next window's start
        self.docs: dict[int, deque] = {lane: deque() for lane in lanes}
        self.pos: dict[int, dict[str, Any]] = {
            lane: {"doc": lane, "addr": None, "off": 0} for lane in lanes}
        if state is not None:
            self.pos = {int(k): {"doc": int(v["doc"]), "off": int(v["off"]),
                                 "addr": None if v["addr"] is None else [int(x) for x in v["addr"]]}
                        for k, v in state.items()}
            if sorted(self.pos) != sorted(lanes):
                raise DataError("the streaming data cursor belongs to other lanes (another "
                                "global_batch, micro_batch, world size or num_workers); resume "
                                "with the same data and batch plan")
        first = min(self.pos.values(), key=lambda s: s["doc"])
        start = first if all(s["addr"] is not None for s in self.pos.values()) else None
        self._feed = reader.read(start["doc"] if start else 0, start["addr"] if start else None)

    def state_dict(self) -> dict[str, Any]:
        return {str(k): dict(v) for k, v in self.pos.items()}

    def _refill(self, lane: int) -> None:
        """Read on until ``lane`` has a new document, tokenising at least ``batch_docs``."""
        texts: list[tuple[int, Address, str]] = []
        while True:
            j, addr, text = next(self._feed)
            owner = j % self.gb
            if owner in self.docs and j >= self.pos[owner]["doc"]:
                texts.append((j, addr, text))
                if owner == lane and len(texts) >= self.batch_docs:
                    break
                if owner == lane and not self.docs[lane]:
                    break
        ids = self.tok.encode_batch([t for _, _, t in texts])
        bos, eos = np.array([self.tok.bos_id]), np.array([self.tok.eos_id])
        for (j, addr, _), arr in zip(texts, ids, strict=True):
            self.docs[j % self.gb].append([j, addr, np.concatenate([bos, arr, eos])])

    def window(self, lane: int) -> tuple[np.ndarray, np.ndarray]:
        """The lane's next window (int64 (seq_len + 1,)) and its inputs' ``doc_ids`` (int32
        (seq_len,): one per piece it is cut from, ``data/documents.py``); moves the position."""
        need, pos, docs = self.seq_len + 1, self.pos[lane], self.docs[lane]
        while sum(len(d[2]) for d in docs) - pos["off"] < need:
            self._refill(lane)
        parts, got, off = [], 0, pos["off"]
        for _, _, tokens in docs:
            piece = tokens[off:off + need - got]
            parts.append(piece)
            got, off = got + len(piece), 0
            if got == need:
                break
        pos["off"] += self.seq_len
        while pos["off"] >= len(docs[0][2]):
            pos["off"] -= len(docs.popleft()[2])
        pos["doc"], pos["addr"] = docs[0][0], docs[0][1]
        doc_ids = documents.from_lengths([len(p) for p in parts], self.seq_len)
        return np.concatenate(parts).astype(np.int64), doc_ids

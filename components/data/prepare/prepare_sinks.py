"""Where ``prepare`` writes tokenised documents: a packed-document layout, or per-domain shards.

Both write into a partial folder and can be cut off at any moment: ``commit`` fsyncs what was
written and returns the counts that ``progress.json`` records; reopening with those counts
truncates anything written after them, so a killed build continues from its last commit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from kiln.components.data.prepare import splits
from kiln.components.data.prepare.encode_pool import Encoded
from kiln.components.data.prepare.packed_layout import TOKENS, document_tokens, finish_layout

LENGTHS, NBYTES = "doc_tokens.bin", "doc_bytes.bin"  # int64 per document, until finished


def _truncate(path: Path, size: int) -> Any:
    f = open(path, "r+b" if path.exists() else "w+b")  # noqa: SIM115 - kept open by the sink
    f.truncate(size)
    f.seek(size)
    return f


class PackedSink:
    """Appends documents, framed by ``separator`` (``splits``), to tokens.bin; ``finish``
    writes the layout. Documents of files from ``first_eval_file`` on are counted: a ``files``
    eval split holds them out."""

    periodic = True  # the builder may commit after any batch

    def __init__(self, folder: Path, dtype: np.dtype, bos: int, eos: int,
                 state: dict[str, int], separator: str = "bos_eos",
                 first_eval_file: int | None = None) -> None:
        self.folder, self.dtype, self.bos, self.eos = folder, np.dtype(dtype), bos, eos
        self.separator, self.first_eval_file = separator, first_eval_file
        self.docs, self.tokens = state.get("docs", 0), state.get("tokens", 0)
        self.eval_docs = state.get("eval_docs", 0)
        self._tokens = _truncate(folder / TOKENS, self.tokens * self.dtype.itemsize)
        self._lengths = _truncate(folder / LENGTHS, self.docs * 8)
        self._nbytes = _truncate(folder / NBYTES, self.docs * 8)

    def add(self, enc: Encoded, positions: list[Any]) -> list[tuple[Any, dict[str, int]]]:
        """Write a batch; returns the commit points it completed (none: commit at will)."""
        if len(enc.lengths):
            framed = splits.framed_lengths(enc.lengths, self.separator)
            self._tokens.write(splits.frame(enc.ids, enc.lengths, self.bos, self.eos,
                                            self.separator).tobytes())
            self._lengths.write(framed.astype(np.int64).tobytes())
            self._nbytes.write(enc.nbytes.astype(np.int64).tobytes())
            self.docs += len(enc.lengths)
            self.tokens += int(framed.sum())
            if self.first_eval_file is not None:  # (positions: one per document, in order)
                self.eval_docs += sum(p[0] >= self.first_eval_file
                                      for p in positions[:len(enc.lengths)])
        return []

    def commit(self) -> dict[str, int]:
        for f in (self._tokens, self._lengths, self._nbytes):
            f.flush()
            os.fsync(f.fileno())
        return {"docs": self.docs, "tokens": self.tokens, "eval_docs": self.eval_docs}

    def close(self) -> None:
        for f in (self._tokens, self._lengths, self._nbytes):
            f.close()

    def finish(self, tok_meta: dict[str, Any], layout: dict[str, Any], source: str
               ) -> dict[str, Any]:
        self.commit()
        self.close()
        lengths = np.fromfile(self.folder / LENGTHS, dtype=np.int64)
        nbytes = np.fromfile(self.folder / NBYTES, dtype=np.int64)
        meta = finish_layout(self.folder, lengths, nbytes, tok_meta, source=source,
                             extra={}, separator=self.separator, eval_docs=self.eval_docs,
                             **layout)
        (self.folder / LENGTHS).unlink()
        (self.folder / NBYTES).unlink()
        return {"docs": meta["num_docs"], "tokens": meta["total_tokens"],
                "bytes": sum(s["bytes"] for s in meta["splits"].values())}


class ShardSink:
    """Documents cut into ``shard_NNNNN.npy`` 1-D token streams of at least ``shard_tokens``
    (whole documents), each written aside and renamed, so a training run that lists the
    domain while this runs only ever sees finished shards."""

    periodic = False  # commits happen when a shard is written (see add)

    def __init__(self, folder: Path, dtype: np.dtype, bos: int, eos: int,
                 state: dict[str, int], shard_tokens: int) -> None:
        self.folder, self.dtype, self.bos, self.eos = folder, np.dtype(dtype), bos, eos
        self.shard_tokens = shard_tokens
        self.shards = state.get("shards", 0)
        self.docs, self.tokens = state.get("docs", 0), state.get("tokens", 0)
        self.bytes = state.get("bytes", 0)
        for stale in folder.glob("shard_*.npy"):  # written after the last commit
            if int(stale.stem.split("_")[1]) >= self.shards:
                stale.unlink()
        self._buf: list[np.ndarray] = []
        self._buf_tokens = self._buf_docs = self._buf_bytes = 0

    def add(self, enc: Encoded, positions: list[Any]) -> list[tuple[Any, dict[str, int]]]:
        """Buffer a batch; returns ``(position, counts)`` for each shard it completed."""
        done = []
        docs = np.split(document_tokens(enc.ids, enc.lengths, self.bos, self.eos),
                        np.cumsum(enc.lengths + 2)[:-1]) if len(enc.lengths) else []
        for i, doc in enumerate(docs):
            self._buf.append(doc)
            self._buf_tokens += len(doc)
            self._buf_docs += 1
            self._buf_bytes += int(enc.nbytes[i])
            if self._buf_tokens >= self.shard_tokens:
                done.append((positions[i], self._flush()))
        return done

    def _flush(self) -> dict[str, int]:
        name = f"shard_{self.shards:05d}.npy"
        part = self.folder / f".{name}.part"
        with open(part, "wb") as f:
            np.save(f, np.concatenate(self._buf).astype(self.dtype, copy=False),
                    allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(part, self.folder / name)
        self.shards += 1
        self.docs += self._buf_docs
        self.tokens += self._buf_tokens
        self.bytes += self._buf_bytes
        self._buf, self._buf_tokens, self._buf_docs, self._buf_bytes = [], 0, 0, 0
        return self.commit()

    def commit(self) -> dict[str, int]:
        return {"shards": self.shards, "docs": self.docs, "tokens": self.tokens,
                "bytes": self.bytes}

    def close(self) -> None:
        self._buf = []

    def finish(self, tok_meta: dict[str, Any], layout: dict[str, Any], source: str
               ) -> dict[str, Any]:
        if self._buf:
            self._flush()
        info = {**tok_meta, "token_dtype": self.dtype.name, "shards": self.shards,
                "total_tokens": self.tokens, "num_docs": self.docs, "bytes": self.bytes,
                "source": source}
        (self.folder / "shards.json").write_text(json.dumps(info, indent=2) + "\n")
        return {"docs": self.docs, "tokens": self.tokens, "bytes": self.bytes,
                "shards": self.shards}

"""The rows of a ``balanced_shards`` dataset, two ways: by row number (``ShardRows``, how a
``mixture`` uses it as one source), and as each domain's endless stream of shards
(``DomainStream``, its own loader's, which picks up shards added while training).

A mixture needs each source's row ``k`` as a pure function of ``k`` (exact shares, resume on any
layout), so here the shard list is taken once, when the reader opens, and shards added later
are not used (``BalancedShards``' own loader picks them up; ``refresh`` does not apply).

Row ``j`` is row ``j // D`` of domain ``j % D`` (D domains, as in ``balanced_shards``). Domain
row ``k`` lies in pass ``k // n`` over the domain's ``n`` train rows, each pass its shards in a
seeded order (a new one each pass) and each shard's rows in a seeded permutation, with the eval
shard's first ``eval_rows`` rows held out. One data epoch is ``D x`` the smallest domain's rows:
the smallest domain read once, the others in part; ``max_epochs`` counts these.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import numpy as np
from pydantic import NonNegativeInt

from kiln.components.data import documents
from kiln.components.data.cursor import Cursor
from kiln.components.data.shard_source import Shard, seeded_rng
from kiln.components.errors import DataError


class ShardRows:
    """Rows of a ``balanced_shards`` split by (data epoch, row): ``read_rows``."""

    def __init__(self, ds: Any, split: str) -> None:
        self.ds, self.split, self.seq_len = ds, split, ds.seq_len
        if not ds.eval_shard and ds.cfg.eval_rows:
            ds.prepare()
        self.domains = list(ds.cfg.domains)
        self._names = {d: sorted(ds.source.list(d)) for d in self.domains}
        if split == "eval":
            if not ds.cfg.eval_rows:
                raise DataError("data.eval_rows = 0: balanced_shards has no eval split; set "
                                "eval_rows > 0")
            self._rows = {d: ds.cfg.eval_rows for d in self.domains}
        else:
            self._sizes = {d: {n: max(ds.shard(n).rows - ds.held_out(d, n), 0)
                               for n in self._names[d]} for d in self.domains}
            self._rows = {d: sum(self._sizes[d].values()) for d in self.domains}
        empty = [d for d in self.domains if not self._rows[d]]
        if empty:
            raise DataError(f"{ds.source.where}/{empty[0]}: no {split} rows in its shards; "
                            "give the domain more data")
        self._passes: dict[tuple[str, int], tuple[list[str], np.ndarray]] = {}
        self._open: dict[tuple[str, str], tuple[Any, np.ndarray]] = {}  # the last few shards

    def rows_per_epoch(self) -> int:
        return len(self.domains) * min(self._rows.values())

    def read_documents(self, epoch: int, first: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
        return self.read_rows(epoch, first + np.arange(rows))

    def read_rows(self, epoch: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows int64 (n, seq_len + 1), their inputs' ``doc_ids`` from BOS tokens)."""
        j = epoch * self.rows_per_epoch() + np.asarray(rows, dtype=np.int64)
        dom, k = j % len(self.domains), j // len(self.domains)
        out = np.empty((len(j), self.seq_len + 1), dtype=np.int64)
        for i in np.unique(dom):
            mask = dom == i
            out[mask] = self._domain_rows(self.domains[i], k[mask])
        bos = getattr(self.ds.tokenizer, "bos_id", None)
        docs = documents.from_bos(out[:, :-1], bos) if bos is not None else \
            np.zeros((len(j), self.seq_len), dtype=np.int32)
        return out, docs

    def _domain_rows(self, domain: str, k: np.ndarray) -> np.ndarray:
        if self.split == "eval":
            return self.ds.shard(self.ds.eval_shard[domain]).read(k)
        out = np.empty((len(k), self.seq_len + 1), dtype=np.int64)
        passes, at = np.divmod(k, self._rows[domain])
        for p in np.unique(passes):
            names, cum = self._pass(domain, int(p))
            sel = passes == p
            shard = np.searchsorted(cum, at[sel], side="right") - 1
            idx = np.flatnonzero(sel)
            for s in np.unique(shard):
                rows = at[sel][shard == s] - cum[s]
                out[idx[shard == s]] = self._read(domain, names[s], rows)
        return out

    def _pass(self, domain: str, p: int) -> tuple[list[str], np.ndarray]:
        """Pass ``p``'s shard order and where each shard starts in it (cached: passes go in
        order, a block of steps may span two)."""
        key = (domain, p)
        if key not in self._passes:
            names = self._names[domain]
            if self.ds.cfg.shuffle:
                names = list(seeded_rng(self.ds.seed, domain, "rows", p).permutation(names))
            sizes = [self._sizes[domain][n] for n in names]
            self._passes = {k: v for k, v in self._passes.items() if k[0] != domain or
                            k[1] == p - 1}
            self._passes[key] = (names, np.concatenate([[0], np.cumsum(sizes)]))
        return self._passes[key]

    def _read(self, domain: str, name: str, offsets: np.ndarray) -> np.ndarray:
        key = (domain, name)
        if key not in self._open:
            n, skip = self._sizes[domain][name], self.ds.held_out(domain, name)
            perm = (seeded_rng(self.ds.seed, domain, name).permutation(n) if self.ds.cfg.shuffle
                    else np.arange(n)) + skip
            self._open = dict(list(self._open.items())[-2 * len(self.domains):])
            self._open[key] = (self.ds.shard(name), perm)
        shard, perm = self._open[key]
        return shard.read(perm[offsets])


class DomainStream:
    """One domain's endless row stream (shards in stream order, extended one shard at a time)."""

    def __init__(self, ds: Any, domain: str) -> None:  # a BalancedShards
        self.ds, self.domain = ds, domain
        self.entries: list[list] = []  # [shard name, train rows] in stream order
        self.base = 0  # stream rows before entries[0] (entries already consumed are dropped)
        self.queue: list[str] = []  # the current pass's remaining shards
        self.seen: list[str] = []
        self.passes = 0
        self._cum: list[int] = [0]
        self._open: dict[str, tuple[Shard, np.ndarray]] = {}

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [list(e) for e in self.entries], "base": self.base,
                "queue": list(self.queue), "seen": list(self.seen), "passes": self.passes}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.entries = [[str(n), int(r)] for n, r in s["entries"]]
        self.base, self.passes = int(s["base"]), int(s["passes"])
        self.queue, self.seen = [str(n) for n in s["queue"]], [str(n) for n in s["seen"]]
        self._reindex()

    def _reindex(self) -> None:
        self._cum = [0]
        for _, rows in self.entries:
            self._cum.append(self._cum[-1] + rows)

    def _extend(self) -> None:
        """Append the next shard: list the domain (new shards join this pass), pop one."""
        if self.ds.cfg.refresh or not self.seen:
            known = set(self.seen)
            new = [n for n in self.ds.source.list(self.domain) if n not in known]
            if new and self.ds.cfg.shuffle:
                rng = seeded_rng(self.ds.seed, self.domain, "new", len(self.seen))
                new = list(rng.permutation(new))
            self.seen += new
            self.queue += new
        if not self.queue:
            if not self.seen:
                raise DataError(f"{self.ds.source.where}/{self.domain}: no .npy shards; check "
                                "the domain names and the folder / repository")
            self.passes += 1
            order = sorted(self.seen)
            if self.ds.cfg.shuffle:
                order = list(seeded_rng(self.ds.seed, self.domain, self.passes).permutation(order))
            self.queue = order
        name = self.queue.pop(0)
        rows = self.ds.shard(name).rows - self.ds.held_out(self.domain, name)
        self.entries.append([name, max(rows, 0)])
        self._cum.append(self._cum[-1] + max(rows, 0))

    def rows(self, ks: np.ndarray, keep_from: int) -> np.ndarray:
        """Stream rows ``ks`` (int64 (n, seq_len + 1)); drops shards ending before keep_from."""
        while int(ks.max()) >= self.base + self._cum[-1]:
            self._extend()
        out = np.empty((len(ks), self.ds.seq_len + 1), dtype=np.int64)
        local = ks - self.base
        idx = np.array([bisect_right(self._cum, int(k)) - 1 for k in local])
        for e in np.unique(idx):
            name = self.entries[e][0]
            mask = idx == e
            out[mask] = self._read(name, local[mask] - self._cum[e])
        while len(self.entries) > 1 and self.base + self._cum[1] <= keep_from:
            self.base += self.entries.pop(0)[1]
            self._reindex()
        return out

    def _read(self, name: str, offsets: np.ndarray) -> np.ndarray:
        if name not in self._open:
            shard = self.ds.shard(name)
            skip = self.ds.held_out(self.domain, name)
            n = shard.rows - skip
            shuffled = self.ds.cfg.shuffle
            perm = (seeded_rng(self.ds.seed, self.domain, name).permutation(n) if shuffled
                    else np.arange(n)) + skip
            self._open = {k: v for k, v in list(self._open.items())[-1:]}  # keep two open
            self._open[name] = (shard, perm)
        shard, perm = self._open[name]
        return shard.read(perm[offsets])


class DomainCursor(Cursor):
    """What ``DomainStream.state_dict`` writes."""

    entries: list[tuple[str, NonNegativeInt]]
    base: NonNegativeInt
    queue: list[str]
    seen: list[str]
    passes: NonNegativeInt

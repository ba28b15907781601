"""A ``balanced_shards`` dataset read by row number: how a ``mixture`` uses it as one source.

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

from typing import Any

import numpy as np

from kiln.components.data import documents
from kiln.components.data.shard_source import seeded_rng
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

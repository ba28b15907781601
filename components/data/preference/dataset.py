"""The ``preference`` dataset: prompts with a chosen and a rejected completion, rendered with a
chat template, completion-only masks, cached.

``prepare()`` reads the rows (``path``, or the built-in arithmetic pairs), checks each pair
(``pairs.py``), renders both sides as the chat data renders a conversation (``encode.py``),
holds out ``eval_fraction`` of the pairs and writes them once into
``$KILN_CACHE/preference/<key>``, as the ``chat`` dataset does (its cache, its checksums, its
cursor). A batch of ``n`` pairs holds ``2n`` rows: the ``n`` chosen sides, then the ``n``
rejected ones in the same order (TRL's concatenated batch), so one forward computes both;
``micro_batch`` and ``global_batch`` count pairs. Each batch carries ``pair_ids``, the stored
index of each row's pair in its split (a precomputed reference's key).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from pydantic import Field

from kiln.components.data.chat import packing
from kiln.components.data.chat.chat_loader import ChatLoader, ChatRows
from kiln.components.data.chat.conversations import read_rows
from kiln.components.data.chat.dataset import ChatDataset, RowsConfig
from kiln.components.data.preference import builtin, encode
from kiln.components.data.preference.pairs import Pair, is_unpaired, to_pair, to_unpaired
from kiln.components.data.prepare.splits import SPLIT_SEED
from kiln.components.errors import DataError
from kiln.components.registry import register

FORMAT = "kiln-preference-v2"  # v2: unpaired examples (labels, KL rows)


class PreferenceConfig(RowsConfig):
    """Where the pairs come from and how they are rendered."""

    path: str = Field("", description='.jsonl(.gz/.zst) / .parquet / .arrow file, folder, glob, '
                      'saved dataset or hf://datasets/OWNER/NAME; "" = the built-in arithmetic '
                      "pairs")
    fields: dict[str, str] = Field(
        default_factory=dict, description="canonical name -> the row's field: prompt, chosen, "
        "rejected, system (a dotted path; a text prompt or system may be a format string)")
    overlong: packing.Overlong = Field(
        "truncate", description="a side longer than seq_len + 1: cut both sides' completions "
        "to the row, drop the pair, or stop with an error")
    eval_fraction: float = Field(0.05, ge=0, lt=1, description="share of pairs held out for "
                                 "evaluation (held-out preference accuracy)")
    builtin_rows: int = Field(4000, ge=2, description='pairs of the built-in set (path = "")')


class PairRows(ChatRows):
    """A split's pairs (stored as rows ``2i``, ``2i + 1``); a batch of ``n`` pairs is its ``n``
    chosen rows, then its ``n`` rejected rows."""

    def __init__(self, folder, split: str, seed: int) -> None:
        super().__init__(folder, split, seed)
        self._labels: np.ndarray | bool | None = None  # None: not read yet; False: pairs

    def __len__(self) -> int:
        return len(self.arrays()[0]) // 2

    def batch(self, epoch: int, first: int, rows: int) -> dict[str, torch.Tensor]:
        return self.pairs(self.pick(epoch, first, rows))

    def pairs(self, at: np.ndarray) -> dict[str, torch.Tensor]:
        """The batch of stored pairs ``at``, with ``pair_ids`` (2n,): each row's pair; for
        unpaired examples also ``desirable`` (n,) bool, each example's label."""
        batch = self.gather(np.concatenate([2 * at, 2 * at + 1]))
        batch["pair_ids"] = torch.from_numpy(np.concatenate([at, at]).astype(np.int64))
        if (labels := self.labels()) is not None:
            batch["desirable"] = torch.from_numpy(labels[at])
        return batch

    def labels(self) -> np.ndarray | None:
        """Unpaired examples' labels (read once), or None for pairs."""
        if self._labels is None:
            path = self.folder / f"{self.split}_labels.npy"
            self._labels = np.load(path, allow_pickle=False) if path.is_file() else False
        return None if self._labels is False else self._labels


class PairLoader(ChatLoader):
    rows_class = PairRows
    examples = "preference pairs"

    def unit(self) -> str:  # a split of 4 pairs was said to hold "4 rows"
        return "pairs" if self._windows.labels() is None else "examples"


@register("dataset", "preference")
class PreferenceDataset(ChatDataset):
    """Preference pairs (prompt, chosen, rejected) with completion-only masks."""

    Config = PreferenceConfig
    cache_name = "preference"
    token_weighted = False  # the loss is a mean over pairs, not over tokens
    loader_class = PairLoader

    def __init__(self, cfg: PreferenceConfig, **context: Any) -> None:
        super().__init__(cfg, **context)
        self._rows_of: dict[str, PairRows] = {}  # each split's rows, for pair_batch

    @property
    def pairs(self) -> str:
        """``"paired"``: batches hold chosen then rejected rows; ``"unpaired"``: examples then
        their mismatched rows, with labels (KTO). A step must take the same."""
        if not self.meta:
            self.prepare()
        return "unpaired" if self.meta.get("unpaired") else "paired"

    def _key_parts(self) -> list[Any]:
        c = self.cfg
        return [FORMAT, self._files_key(), c.split, sorted(c.fields.items()),
                self.template.source, self.template.specials, self.tokenizer.fingerprint(),
                self.seq_len, c.overlong, c.eval_fraction, SPLIT_SEED]

    def _rows(self):
        if not self.cfg.path:
            return ((f"built-in preference set: row {i}", r)
                    for i, r in enumerate(builtin.pairs(self.cfg.builtin_rows, SPLIT_SEED)))
        return read_rows(self.cfg.path, split=self.cfg.split, cache_dir=self.cfg.cache_dir)

    def _build(self, folder) -> None:
        c = self.cfg
        rows = list(self._rows())
        if not rows:
            raise DataError(f"data.path = {c.path!r}: no preference pairs there")
        unpaired = is_unpaired(rows[0][1], c.fields)
        for where, row in rows:
            if is_unpaired(row, c.fields) != unpaired:
                raise DataError(f"{where}: {'a pair' if unpaired else 'an unpaired example'} "
                                f"among {'unpaired examples' if unpaired else 'pairs'}; a file "
                                "holds one kind (chosen / rejected, or completion / label)")
        if unpaired:
            examples = [(where, to_unpaired(row, c.fields, where)) for where, row in rows]
            splits, extra = self._unpaired_splits(examples)
        else:
            pairs = [(where, encode.encode_pair(self.template, self.tokenizer,
                                                to_pair(row, c.fields, where), where,
                                                bos=self.template.adds_bos))
                     for where, row in rows]
            splits, extra = self._splits(pairs, lambda split, i: pairs[i][1]), None
        self._write(folder, splits, {"format": FORMAT, "unpaired": unpaired}, extra)

    def _splits(self, items: list, pair_of, kept: list | None = None) -> dict:
        """Each split's rows and counts; ``pair_of(split, i)``: item i's encoded sides;
        ``kept`` collects each split's kept item indices."""
        c, width = self.cfg, self.seq_len + 1
        splits = {}
        for split, picked in self._split_of(len(items)).items():
            stats, fitted, at = encode.PairStats(), [], []
            for i in sorted(picked):
                if (f := encode.fit_pair(pair_of(split, i), width, c.overlong, items[i][0],
                                         stats)) is not None:
                    fitted.append(f)
                    at.append(i)
            if picked.size and not fitted:
                raise DataError(
                    f"data: every one of the {stats.pairs} {split} pairs was dropped: each has "
                    f"a side longer than training.seq_len + 1 = {width} tokens (data.overlong "
                    f"= {c.overlong!r}, and truncating would leave no completion token); raise "
                    "training.seq_len")
            if kept is not None:
                kept.append(at)
            splits[split] = (encode.rows(fitted, width, self.pad_id, stats), stats.as_dict())
        return splits

    def _unpaired_splits(self, examples: list) -> tuple[dict, dict[str, np.ndarray]]:
        """KTO's examples: row ``2i`` the example, row ``2i + 1`` its mismatched row (its
        prompt with the next example's completion in the split: the KL term's sample, fixed
        here since the loader shuffles), and each split's labels."""
        order = {split: sorted(picked) for split, picked in
                 self._split_of(len(examples)).items()}

        place = {split: {i: k for k, i in enumerate(ids)} for split, ids in order.items()}

        def pair_of(split: str, i: int):
            ids = order[split]
            after = examples[ids[(place[split][i] + 1) % len(ids)]][1]
            prompt, completion, _ = examples[i][1]
            return encode.encode_pair(self.template, self.tokenizer,
                                      Pair(prompt, completion, after[1]), examples[i][0],
                                      bos=self.template.adds_bos)

        kept: list[list[int]] = []
        splits = self._splits(examples, pair_of, kept)
        labels = {f"{split}_labels": np.array([examples[i][1][2] for i in at], dtype=bool)
                  for split, at in zip(splits, kept, strict=True)}
        return splits, labels

    def describe(self) -> str:
        t = self.meta["splits"]["train"]
        kept = t["pairs"] - t["dropped"]
        if self.meta.get("unpaired"):
            return (f"preference data, unpaired (KTO): {kept} train examples of {t['pairs']}, "
                    f"each with a mismatched row for the KL term, in rows of "
                    f"{self.seq_len + 1} tokens; {t['truncated']} truncated, {t['dropped']} "
                    f"dropped (data.overlong = {self.cfg.overlong!r}); template "
                    f"{self.template.name}")
        return (f"preference data: {kept} train pairs of {t['pairs']} in rows of "
                f"{self.seq_len + 1} tokens ({t['trained']} completion tokens of "
                f"{t['tokens']}); {t['truncated']} truncated, {t['dropped']} dropped "
                f"(data.overlong = {self.cfg.overlong!r}); template {self.template.name}")

    def _split_rows(self, split: str) -> PairRows:
        if not self.meta:
            self.prepare()
        if split not in self._rows_of:
            self._rows_of[split] = PairRows(self.folder, split, self.seed)
        return self._rows_of[split]

    def pair_count(self, split: str) -> int:
        """Pairs stored in ``split``."""
        return len(self._split_rows(split))

    def pair_batch(self, split: str, ids: np.ndarray) -> dict[str, torch.Tensor]:
        """The pairs ``ids`` of ``split`` as one batch (chosen rows, then rejected rows, with
        ``pair_ids``): what a step reads to compute something once per pair."""
        return self._split_rows(split).pairs(np.asarray(ids, dtype=np.int64))


"""The ``chat`` dataset: conversations rendered with a chat template, masked, packed, cached.

``prepare()`` reads the rows (``path``, or the built-in arithmetic dialogues), renders each with
the template, finds the assistant's tokens (``masks.py``), holds out ``eval_fraction`` of the
conversations, packs both splits into rows (``packing.py``) and writes them once into
``$KILN_CACHE/chat/<key>`` (the key hashes everything that changes the rows: files, fields,
template, tokenizer, seq_len, policies, seed); a second run reuses the folder. The loader serves
rows in a seeded order per data epoch, sharded by global step like ``packed_documents``, so 1 and
2 processes see the same global batch and a resume is a seek.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.data.chat import builtin, conversations, masks, packing
from kiln.components.data.chat.chat_loader import SPLIT_FILES, ChatLoader
from kiln.components.data.packed_documents import cache_root
from kiln.components.data.prepare.packed_layout import file_lock
from kiln.components.data.prepare.splits import SPLIT_SEED
from kiln.components.errors import DataError
from kiln.components.protocols import DatasetContract
from kiln.components.registry import register
from kiln.components.sources.text_sources import expand_inputs
from kiln.components.tokenizers import chat_templates as templates

FORMAT = "kiln-chat-v2"  # v2: meta.json records the rows' checksum and empty assistant turns


class RowsConfig(ComponentConfig):
    """What chat, preference and prompt data share: the split, the template, the cache."""

    split: str = Field("train", description="split of a saved or Hub dataset")
    template: str = Field("", description='chat template: "" = the tokenizer\'s Hugging Face '
                          'folder, "chatml", a .jinja file or a model folder')
    cache_dir: str = Field("", description='cache root; "" = $KILN_CACHE or ~/.cache/kiln')


class ChatConfig(RowsConfig):
    """Where the conversations come from, how they are rendered, masked and packed."""

    path: str = Field("", description='.jsonl(.gz/.zst) / .parquet / .arrow file, folder, glob, '
                      'saved dataset or hf://datasets/OWNER/NAME; "" = the built-in arithmetic '
                      "dialogues")
    fields: dict[str, str] = Field(
        default_factory=dict, description="canonical name -> the row's field: messages, or "
        'prompt / completion / system (a dotted path or a format string like "{instruction}'
        '\\n\\n{input}")')
    train_on: masks.TrainOn = Field("assistant", description="tokens the loss is taken on: "
                                    "every assistant turn, the last one, or all tokens")
    pack: bool = Field(True, description="several conversations per row (false: one per row, "
                       "padded)")
    overlong: packing.Overlong = Field(
        "truncate", description="a conversation longer than seq_len + 1: keep its first "
        "tokens, drop it, or stop with an error")
    eval_fraction: float = Field(0.05, ge=0, lt=1, description="share of conversations held "
                                 "out for evaluation")
    builtin_rows: int = Field(4000, ge=2, description='conversations of the built-in set '
                              '(path = "")')


@register("dataset", "chat")
class ChatDataset(DatasetContract):
    """Conversations with assistant-only loss masks; the loss is token-weighted."""

    Config = ChatConfig
    cache_name = "chat"  # its folder under the cache root
    token_weighted = True  # the step averages over the global batch's trained tokens
    split_files = SPLIT_FILES  # the arrays ``_write`` stores per split
    loader_class = ChatLoader  # how a split's rows are served

    @property
    def padded_rows(self) -> bool:
        """One conversation a row, padded to seq_len (``pack = false``). Preference and prompt
        rows, padded too, are cut by their own steps (``token_logprobs``)."""
        return not self.cfg.pack if isinstance(self.cfg, ChatConfig) else False

    def __init__(self, cfg: ChatConfig, *, tokenizer: Any, seq_len: int, seed: int = 0,
                 **context: Any) -> None:
        self.cfg, self.tokenizer, self.seq_len, self.seed = cfg, tokenizer, seq_len, seed
        self.template = templates.resolve(cfg.template, tokenizer)
        self._folder: Path | None = None
        self.meta: dict[str, Any] = {}

    def _files_key(self) -> list[Any]:
        if not self.cfg.path:
            return ["builtin", self.cfg.builtin_rows]
        files = expand_inputs([self.cfg.path], split=self.cfg.split, cache_dir=self.cfg.cache_dir)
        local = [Path(f.name) for f in files if Path(f.name).is_file()]  # Hub files: by name
        return [self.cfg.path, [f.name for f in files],
                [(p.stat().st_size, p.stat().st_mtime_ns) for p in local]]

    @property
    def folder(self) -> Path:
        if self._folder is None:
            key = hashlib.sha256(json.dumps(self._key_parts(), default=str).encode())
            self._folder = cache_root(self.cfg.cache_dir) / self.cache_name / key.hexdigest()[:16]
        return self._folder

    def _key_parts(self) -> list[Any]:
        """Everything that changes the prepared rows (the cache entry's key). ``SPLIT_SEED``
        stands where training.seed stood before the split left it (entries of seed 0 keep
        their keys); the preference and prompt datasets' keys do the same."""
        c = self.cfg
        return [FORMAT, self._files_key(), c.split, sorted(c.fields.items()),
                self.template.source, self.template.specials, self.tokenizer.fingerprint(),
                self.seq_len, c.train_on, c.pack, c.overlong, c.eval_fraction, SPLIT_SEED]

    def prepare(self, *, create: bool = False) -> Path:
        folder = self.folder
        if not (folder / "meta.json").exists():
            with file_lock(folder.parent / f".{folder.name}.lock"):
                if not (folder / "meta.json").exists():
                    self._build(folder)
        try:
            self.meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError) as exc:
            raise DataError(f"{folder}/meta.json: unreadable ({exc}); delete the folder to "
                            "rebuild it") from None
        return folder

    def _rows(self):
        if not self.cfg.path:
            return ((f"built-in chat set: row {i}", r)
                    for i, r in enumerate(builtin.conversations(self.cfg.builtin_rows, SPLIT_SEED)))
        return conversations.read_rows(self.cfg.path, split=self.cfg.split,
                                       cache_dir=self.cfg.cache_dir)

    def _build(self, folder: Path) -> None:
        c, width = self.cfg, self.seq_len + 1
        encoded: list[tuple[str, tuple[np.ndarray, np.ndarray]]] = []
        empty = 0  # assistant turns with no text: kept, trained on their end of turn only
        for where, row in self._rows():
            messages = conversations.to_messages(row, c.fields, where)
            empty += sum(m["role"] == "assistant" and not m["content"].strip()
                         for m in messages)
            encoded.append((where, masks.encode(self.template, self.tokenizer, messages,
                                                c.train_on, where, bos=self.template.adds_bos)))
        if not encoded:
            raise DataError(f"data.path = {c.path!r}: no conversations there")
        splits = {}
        for split, picked in self._split_of(len(encoded)).items():
            stats = packing.PackStats()
            fitted = [f for i in sorted(picked) if (f := packing.fit(
                *encoded[i][1], width, c.overlong, encoded[i][0], stats)) is not None]
            arrays = packing.pack(fitted, width, packed=c.pack, pad_id=self.pad_id, stats=stats)
            splits[split] = (arrays, stats.as_dict())
        self._write(folder, splits, {"format": FORMAT, "train_on": c.train_on, "pack": c.pack,
                                     "empty_assistant_turns": empty})

    def _split_of(self, n: int) -> dict[str, np.ndarray]:
        """The examples of each split: ``eval_fraction`` of them held out, in a seeded order
        (``SPLIT_SEED``: the same for every training.seed, which orders the train rows)."""
        order = np.random.default_rng([SPLIT_SEED, 0xC4A7]).permutation(n)
        n_eval = int(round(n * self.cfg.eval_fraction))
        return {"eval": order[:n_eval], "train": order[n_eval:]}

    @property
    def pad_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_id", None)
        return self.tokenizer.eos_id if pad is None else pad

    def _write(self, folder: Path, splits: dict[str, tuple[tuple[np.ndarray, ...], dict]],
               meta: dict[str, Any], extra: dict[str, np.ndarray] | None = None,
               aside: dict[str, np.ndarray] | None = None) -> None:
        """Each split's arrays (``SPLIT_FILES``), ``extra`` arrays by file name and
        ``meta.json`` (with the splits' counts and the rows' checksum), into ``folder`` at
        once: written aside, then renamed. ``aside``: arrays by file name kept out of the
        checksum (where each row came from, for messages: not the rows themselves)."""
        tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        meta = {**meta, "seq_len": self.seq_len, "splits": {}, "overlong": self.cfg.overlong,
                "template": {"name": self.template.name, "sha256": self.template.fingerprint,
                             "source": self.template.source},
                "tokenizer": self.tokenizer.fingerprint(),
                "vocab_size": int(self.tokenizer.vocab_size)}
        rows = xxhash.xxh3_128()
        for split, (arrays, stats) in splits.items():
            for name, array in zip(self.split_files, arrays, strict=True):
                np.save(tmp / f"{split}_{name}.npy", array, allow_pickle=False)
                rows.update(np.ascontiguousarray(array).view(np.uint8))
            meta["splits"][split] = stats
        for name, array in (extra or {}).items():
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
            rows.update(np.ascontiguousarray(array).view(np.uint8))
        meta["rows_xxh3"] = rows.hexdigest()
        for name, array in (aside or {}).items():
            np.save(tmp / f"{name}.npy", array, allow_pickle=False)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, folder)
        except OSError:  # another process won the race with the same rows
            shutil.rmtree(tmp, ignore_errors=True)

    def fingerprints(self) -> dict[str, str]:
        """The rows a run's cursor points into, saved with every checkpoint: the cache entry
        (its key hashes the files' sizes and modification times, the template, tokenizer and
        policies) and its rows' checksum."""
        return {"data": f"{self.folder.name}:{self.meta.get('rows_xxh3', '')}"}

    def describe(self) -> str:
        """One line for the log: conversations, rows, truncated / dropped, trained tokens."""
        t = self.meta["splits"]["train"]
        return (f"chat data: {t['conversations']} train conversations in {t['rows']} rows of "
                f"{self.seq_len + 1} tokens ({t['trained']} trained tokens, "
                f"{t['trained'] / max(t['tokens'], 1):.0%} of the conversations' tokens); "
                f"{t['truncated']} truncated, {t['dropped']} dropped (data.overlong = "
                f"{self.cfg.overlong!r}); template {self.template.name}"
                + (f"; {empty} empty assistant turns (trained on their end of turn only)"
                   if (empty := self.meta.get("empty_assistant_turns")) else ""))

    @property
    def tokens_per_epoch(self) -> int:
        return int(self.meta["splits"]["train"]["rows"]) * self.seq_len

    def tokens_per_byte(self, split: str = "eval") -> float | None:
        return None  # masked targets: bits per byte of what, is not defined

    def loader(self, split: str, *, micro_batch: int, global_batch: int, rank: int = 0,
               world_size: int = 1) -> ChatLoader:
        if not self.meta:
            self.prepare()
        path = getattr(self.cfg, "path", "")
        source = (f"data.path = {path!r}" if path else "the built-in rows") + \
            f" (prepared in {self.folder})"
        return self.loader_class(self.folder, split, seq_len=self.seq_len,
                                 micro_batch=micro_batch, global_batch=global_batch, rank=rank,
                                 world_size=world_size, seed=self.seed, source=source)

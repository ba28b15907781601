"""The ``prompts`` dataset: prompts to sample completions from (reinforcement learning with
rewards), rendered with a chat template and its generation prompt, with the fields the rewards
read.

``prepare()`` reads the rows (``path``, or the built-in arithmetic questions), renders each
prompt exactly as ``kiln eval``'s chat tasks do (``chat_templates.prompt_ids``: the messages,
then the template's generation prompt), holds out ``eval_fraction`` of them and writes them once
into ``$KILN_CACHE/prompts/<key>`` with the chat data's cache, checksums and cursor. Each row's
other scalar fields (``answer``, ...) are kept as JSON beside the tokens, never pickled; a
reward names the field it reads. A batch holds ``prompt_ids`` (right-padded),
``prompt_lengths`` and ``rows`` (each prompt's stored index in its split, for its fields):
``micro_batch`` and ``global_batch`` count prompts.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import numpy as np
import torch
from pydantic import Field

from kiln.components.data.chat import packing
from kiln.components.data.chat.chat_loader import ChatLoader, ChatRows
from kiln.components.data.chat.conversations import check, prompt_messages, read_rows
from kiln.components.data.chat.dataset import ChatDataset, RowsConfig
from kiln.components.data.prepare.splits import SPLIT_SEED
from kiln.components.data.prompts import builtin
from kiln.components.errors import DataError
from kiln.components.registry import register
from kiln.components.tokenizers import chat_templates as templates

FORMAT = "kiln-prompts-v1"
FILES = ("prompts", "lengths", "fields")


class PromptConfig(RowsConfig):
    """Where the prompts come from and how they are rendered."""

    path: str = Field("", description='.jsonl(.gz/.zst) / .parquet / .arrow file, folder, glob, '
                      'saved dataset or hf://datasets/OWNER/NAME; "" = the built-in arithmetic '
                      "questions")
    fields: dict[str, str] = Field(
        default_factory=dict, description="canonical name -> the row's field: prompt (text, "
        "messages or a format string), system")
    overlong: packing.Overlong = Field(
        "error", description="a prompt longer than seq_len tokens: stop with an error, drop "
        "it, or keep its last seq_len tokens (truncate)")
    eval_fraction: float = Field(0.05, ge=0, lt=1, description="share of prompts held out")
    builtin_rows: int = Field(4000, ge=2, description='prompts of the built-in set (path = "")')


class PromptRows(ChatRows):
    """A split's prompts; a batch is ``rows`` prompts of the epoch's order."""

    files = FILES

    def gather(self, at: np.ndarray) -> dict[str, torch.Tensor]:
        prompts, lengths, _ = self.arrays()
        lengths = np.asarray(lengths[at]).astype(np.int64)
        width = int(lengths.max()) if len(lengths) else 1
        return {"prompt_ids": torch.from_numpy(np.asarray(prompts[at, :width], np.int64)),
                "prompt_lengths": torch.from_numpy(lengths),
                "rows": torch.from_numpy(at.astype(np.int64))}

    def fields(self, at: list[int]) -> list[dict[str, Any]]:
        column = self.arrays()[2]
        return [json.loads(str(column[i])) for i in at]

    def where(self, row: int) -> str | None:
        """The file and line (or row) prompt ``row`` came from; None for a cache entry written
        before kiln kept it."""
        path = self.folder / f"{self.split}_where.npy"
        if not path.exists():
            return None
        return bytes(np.load(path, mmap_mode="r", allow_pickle=False)[row]).decode()


class PromptLoader(ChatLoader):
    rows_class = PromptRows
    examples = "prompts"

    def unit(self) -> str:
        return "prompts"


@register("dataset", "prompts")
class PromptDataset(ChatDataset):
    """Prompts rendered for generation, with the fields rewards check."""

    Config = PromptConfig
    cache_name = "prompts"
    token_weighted = False
    split_files = FILES
    loader_class = PromptLoader
    pairs = "prompts"  # the step must take prompts (``StepContract.takes_pairs``)

    def __init__(self, cfg: PromptConfig, **context: Any) -> None:
        super().__init__(cfg, **context)
        self._rows_of: dict[str, PromptRows] = {}

    def _key_parts(self) -> list[Any]:
        c = self.cfg
        return [FORMAT, self._files_key(), c.split, sorted(c.fields.items()),
                self.template.source, self.template.specials, self.tokenizer.fingerprint(),
                self.seq_len, c.overlong, c.eval_fraction, SPLIT_SEED]

    def _rows(self):
        if not self.cfg.path:
            return ((f"built-in prompt set: row {i}", r)
                    for i, r in enumerate(builtin.prompts(self.cfg.builtin_rows, SPLIT_SEED)))
        return read_rows(self.cfg.path, split=self.cfg.split, cache_dir=self.cfg.cache_dir)

    def _encode(self, where: str, row: dict) -> tuple[list[int], str, list[str]]:
        messages = prompt_messages(row, self.cfg.fields, where)
        if not messages or messages[-1]["role"] != "user":
            raise DataError(f"{where}: the prompt must end with a user message (the completion "
                            "is the assistant's answer to it)")
        check(messages + [{"role": "assistant", "content": "-"}], where)
        ids = templates.prompt_ids(self.template, self.tokenizer, messages)
        used = {self.cfg.fields.get("prompt", "prompt"), self.cfg.fields.get("system")}
        kept = {k: v for k, v in row.items() if k not in used
                and isinstance(v, str | int | float | bool)}
        # (a nested field or a list is left out; a reward naming it is told where it was)
        left = [k for k, v in row.items() if k not in used and k not in kept and v is not None]
        return ids, json.dumps(kept, ensure_ascii=False), left

    def _build(self, folder) -> None:
        c, width = self.cfg, self.seq_len
        encoded = [(where, *self._encode(where, row)) for where, row in self._rows()]
        if not encoded:
            raise DataError(f"data.path = {c.path!r}: no prompts there")
        splits, wheres_of, kept = {}, {}, []  # kept: (where, its field names) of each prompt
        for split, picked in self._split_of(len(encoded)).items():
            ids, fields, truncated, dropped, wheres = [], [], 0, 0, []
            for i in sorted(picked):
                where, p, f, _ = encoded[i]
                if len(p) > width:
                    if c.overlong == "error":
                        raise DataError(
                            f"{where}: the prompt is {len(p)} tokens, longer than "
                            f"training.seq_len = {width}; raise seq_len, shorten it, or set "
                            'data.overlong = "drop" or "truncate" (keeps its last tokens)')
                    if c.overlong == "drop":
                        dropped += 1
                        continue
                    p, truncated = p[-width:], truncated + 1
                ids.append(p)
                fields.append(f)
                wheres.append(where)
                kept.append((where, set(json.loads(f))))
            prompts = np.full((len(ids), width), self.pad_id, dtype=np.int32)
            for r, p in enumerate(ids):
                prompts[r, :len(p)] = p
            lengths = np.array([len(p) for p in ids], dtype=np.int32)
            splits[split] = ((prompts, lengths, np.array(fields, dtype=str)), {
                "prompts": len(ids), "truncated": truncated, "dropped": dropped,
                "longest": int(lengths.max()) if len(ids) else 0})
            # (UTF-8 bytes: a quarter of numpy's fixed-width text)
            wheres_of[f"{split}_where"] = np.array([w.encode() for w in wheres], dtype=bytes)
        common = set.intersection(*(keys for _, keys in kept)) if kept else set()
        # What a reward naming a field no prompt or not every prompt has is told: how many
        # have it and where the first without it came from; where one held a list or a table.
        partial = {k: [sum(k in keys for _, keys in kept),
                       next(w for w, keys in kept if k not in keys)]
                   for k in sorted(set().union(*(keys for _, keys in kept)) - common)}
        nested = {k: where for where, _, _, left in reversed(encoded) for k in left}
        self._write(folder, splits, {"format": FORMAT, "fields": sorted(common),
                                     "partial_fields": partial, "nested_fields": nested},
                    aside=wheres_of)

    # ------------------------------------------------------------------ what the step reads
    @property
    def field_names(self) -> list[str]:
        """The fields every prompt has (what a reward may name)."""
        if not self.meta:
            self.prepare()
        return list(self.meta["fields"])

    def field_problem(self, name: str) -> str:
        """Why a reward cannot read field ``name`` of every prompt, as a clause: "which ..."."""
        if not self.meta:
            self.prepare()
        meta = self.meta
        if name in meta.get("nested_fields", {}):
            return (f"which {meta['nested_fields'][name]} holds as a list or a table (a reward "
                    "reads text, numbers and booleans)")
        if name in meta.get("partial_fields", {}):
            have, where = meta["partial_fields"][name]
            total = sum(s["prompts"] for s in meta["splits"].values())
            return f"which {have} of the {total} prompts have; the first without it: {where}"
        every = ", ".join(self.field_names) or "none"
        if "partial_fields" not in meta:  # a cache entry written before kiln counted them
            return f"which not every prompt has (every prompt has: {every})"
        return f"which no prompt has (every prompt has: {every})"

    def prompt_where(self, split: str, row: int) -> str:
        """Where prompt ``row`` of ``split`` came from (file and line), for messages."""
        return self._split(split).where(row) or f"{split} prompt {row}"

    @property
    def longest_prompt(self) -> int:
        if not self.meta:
            self.prepare()
        return max(s["longest"] for s in self.meta["splits"].values())

    def _split(self, split: str) -> PromptRows:
        if split not in self._rows_of:
            self._rows_of[split] = PromptRows(self.prepare(), split, self.seed)
        return self._rows_of[split]

    def prompt_fields(self, split: str, rows: list[int]) -> list[dict[str, Any]]:
        """The stored fields of prompts ``rows`` of ``split``."""
        return self._split(split).fields(rows)

    def prompt_ids(self, split: str, rows: list[int]) -> list[list[int]]:
        """The token ids of prompts ``rows`` of ``split``."""
        batch = self._split(split).gather(np.asarray(rows, dtype=np.int64))
        return [ids[:n] for ids, n in zip(batch["prompt_ids"].tolist(),
                                          batch["prompt_lengths"].tolist(), strict=True)]

    def prompt_count(self, split: str) -> int:
        return len(self._split(split))

    def decode(self, ids: list[int]) -> str:
        """A completion's text, the template's special tokens kept (so a stop string such as
        ChatML's end of turn can cut it)."""
        if "skip_special" in inspect.signature(self.tokenizer.decode).parameters:
            return self.tokenizer.decode(ids, skip_special=False)
        return self.tokenizer.decode(ids)

    @property
    def stop_strings(self) -> list[str]:
        """Where a completion ends: the template's end of turn."""
        end = templates.end_of_turn(self.template)
        return [end] if end else []

    def describe(self) -> str:
        t, e = self.meta["splits"]["train"], self.meta["splits"].get("eval", {})
        return (f"prompt data: {t['prompts']} train prompts, {e.get('prompts', 0)} held out; "
                f"the longest {self.longest_prompt} tokens; {t['truncated']} truncated, "
                f"{t['dropped']} dropped (data.overlong = {self.cfg.overlong!r}); template "
                f"{self.template.name}; fields: {', '.join(self.field_names) or 'none'}")

    @property
    def tokens_per_epoch(self) -> int:
        return int(self.meta["splits"]["train"]["prompts"]) * self.seq_len


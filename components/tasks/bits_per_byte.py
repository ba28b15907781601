"""Bits per byte of documents: ``sum of token NLLs / ln 2 / UTF-8 bytes``, comparable across
tokenizers (the held-out ``eval/bpb`` of a run, as a task on any text).

Documents: one per row of a JSONL / JSON / parquet file (``{"text": str}``; ``fields.text``
maps another field), or a whole ``.txt`` file as one. A document is scored from the BOS token
(EOS without one) in windows of at most the model's context, each token predicted once; the last
window of a long document is widened to the full context (lm-evaluation-harness's
``loglikelihood_rolling``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import ClassVar

import torch

from kiln.components.errors import DataError
from kiln.components.registry import register
from kiln.components.tasks import common, task_files


class BitsPerByteConfig(common.TaskConfig):
    """Bits per byte of documents."""

    field_names: ClassVar[tuple[str, ...]] = ("text",)


def windows(tokens: list[int], prefix: int, max_len: int) -> list[tuple[list[int], int]]:
    """(ids, n): each window scores its last n ids; every token of ``tokens`` once, each
    with as much context as fits (at most ``max_len`` inputs)."""
    full = [prefix, *tokens]
    out, start = [], 0
    while start < len(tokens):
        stop = min(start + max_len, len(tokens))
        out.append((full[max(0, stop - max_len):stop + 1], stop - start))
        start = stop
    return out


@register("task", "bits_per_byte")
class BitsPerByte(common.Task):
    """Bits per UTF-8 byte of documents (token NLL / ln 2 / bytes)."""

    Config = BitsPerByteConfig
    columns = ["nll"]
    headline = "bits_per_byte"

    def rows(self) -> tuple[list[dict], str]:
        if self.cfg.path.endswith(".txt"):
            file = task_files.local_path(self.cfg.path, self.name)
            return [{"text": file.read_text(encoding="utf-8")}], str(Path(file))
        return super().rows()

    def plan(self, tokenizer, max_len: int) -> common.Plan:
        if self.cfg.num_fewshot:
            raise DataError(f"task {self.name!r}: bits_per_byte takes no few-shot examples "
                            "(num_fewshot = 0)")
        rows, label = self.rows()
        prefix = tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id
        units: list[tuple[list[int], int]] = []
        self.total_bytes = 0
        for i, row in enumerate(rows):
            text = task_files.text(row, str(self.path_of("text")), self.where(label, i))
            self.total_bytes += len(text.encode("utf-8"))
            units += windows(tokenizer.encode(text, bos=False, eos=False), prefix, max_len)
        if not units:
            raise DataError(f"task {self.name!r}: {label}: the documents are empty")
        sizes = [len(ids) for ids, _ in units]
        return common.Plan(len(units), list(self.columns), [
            common.Batch(b, [units[u] for u in b])
            for b in common.batches(list(range(len(units))), sizes, self.cfg.batch_size)
        ], examples=len(rows))

    def score(self, scorer, batch: common.Batch) -> torch.Tensor:
        return torch.tensor([[-ll] for ll, _ in scorer.score_rows(batch.payload)],
                            dtype=torch.float64)

    def summarize(self, values: torch.Tensor) -> dict[str, float]:
        """Bits per byte and its standard error: the windows' summed NLL over the bytes, the
        windows taken as independent draws (n x the standard error of their mean)."""
        scale = math.log(2) * self.total_bytes
        n = values.shape[0]
        return {"bits_per_byte": float(values[:, 0].sum()) / scale,
                "bits_per_byte" + common.STDERR: common.mean_stderr(values[:, 0]) * n / scale}

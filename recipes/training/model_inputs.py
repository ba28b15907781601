"""What a micro-batch becomes for the model: this rank's share of the sequence and the attention
context (document mask, context parallel).

Loaders give whole rows: ``input_ids``, ``labels`` and ``doc_ids`` (B, T). With
``model.attention.document_mask`` the rows' ``doc_ids`` become an ``AttentionContext``
(``components/attention/context.py``) that every block's attention obeys. Under context
parallelism (``parallelism.cp``) the peers of a context-parallel group share their rows; each
keeps its load-balanced share of the positions (``parallelisms/context_parallel.py``) of the
inputs and labels, while the mask sees the whole rows' documents, and the attention gathers the
keys and values of the whole sequence. RoPE positions are the global ones (or per document), so a
token computes the same thing on any number of ranks.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from kiln.components.attention.context import build_context, choose_kernel
from kiln.components.errors import DataError, RecipeError

_KERNEL_TEXT = {
    "sdpa": "SDPA with a dense mask (FlexAttention has no CPU backward in torch 2.13)",
    "flex": "FlexAttention with a block mask (compiled; fully masked tiles skipped)",
}


class ModelInputs:
    """Called per micro-batch: ``(input_ids, labels, model keyword arguments)`` of this rank."""

    def __init__(self, attention_cfg: Any, device: torch.device, cp: Any = None) -> None:
        self.document_mask = bool(getattr(attention_cfg, "document_mask", False))
        self.per_document = getattr(attention_cfg, "positions", "sequence") == "per_document"
        self.cp = cp if cp is not None and cp.size > 1 else None
        self.kernel = "sdpa"
        if self.document_mask or self.cp is not None:
            self.kernel = choose_kernel(getattr(attention_cfg, "mask_kernel", "auto"), device)

    @property
    def needs_context(self) -> bool:
        return self.document_mask or self.cp is not None

    def check_model(self, model: torch.nn.Module) -> None:
        """A document mask or context parallel needs a model whose forward takes ``context``."""
        if self.needs_context and "context" not in inspect.signature(model.forward).parameters:
            what = ("model.attention.document_mask = true" if self.document_mask
                    else f"parallelism.cp = {self.cp.size}")
            raise RecipeError(
                f"{what} needs a model whose forward takes context= (docs/design.md: attention "
                f"context); {type(model).__name__} does not: use model.type = \"transformer\" or "
                "\"looped\", or turn the option off")

    def describe(self) -> str:
        """The start-up line (empty when attention is plain causal)."""
        if not self.needs_context:
            return ""
        parts = []
        if self.document_mask:
            per_doc = ", positions per document" if self.per_document else ""
            parts.append(f"document mask{per_doc}")
        if self.cp is not None:
            parts.append(self.cp.describe())
        return f"attention: {' + '.join(parts)}: {_KERNEL_TEXT[self.kernel]}"

    def __call__(self, batch: dict[str, torch.Tensor]
                 ) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
        ids, labels = batch["input_ids"], batch["labels"]
        if not self.needs_context:
            return ids, labels, {}
        doc_ids = None
        if self.document_mask:
            doc_ids = batch.get("doc_ids")
            if doc_ids is None:
                raise DataError(
                    "model.attention.document_mask = true, but the dataset's batches carry no "
                    "doc_ids (document boundaries); use a built-in dataset (packed_documents, "
                    "streaming_text, balanced_shards with a tokenizer) or set document_mask = "
                    "false")
        length = ids.shape[1]
        positions = gather_kv = None
        if self.cp is not None:
            positions = self.cp.positions(length, ids.device)  # (T / cp,) this rank's share
            ids, labels = ids[:, positions], labels[:, positions]
            gather_kv = self.cp.gatherer(length, ids.device)
        context = build_context(
            length, doc_ids=doc_ids, query_positions=positions, per_document=self.per_document,
            kernel=self.kernel, gather_kv=gather_kv)
        return ids, labels, {"context": context}

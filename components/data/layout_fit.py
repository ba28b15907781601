"""Whether a packed layout's splits fill one batch, and what to change when one does not.

Pure arithmetic on ``metadata.json`` (no torch, no numpy), so ``kiln data prepare`` can warn
about a split too small for the recipe's batch plan while staying a light process; the loader
raises the same message when it is built (the trainer builds the eval loader at start-up).
"""

from __future__ import annotations

import math
from typing import Any


def too_small(meta: dict[str, Any], split: str, *, seq_len: int, global_batch: int,
              world_size: int, prepared: bool) -> str | None:
    """Why ``split`` of a layout (``meta``: its metadata.json) cannot fill one batch of
    ``global_batch`` rows of ``seq_len + 1`` tokens, with what to change (None: it can). The
    eval loader's batch is training.micro_batch rows per data-parallel rank (``hooks.evaluate``);
    the train loader's is training.global_batch."""
    info = meta["splits"][split]
    need = global_batch * seq_len + 1
    if info["tokens"] >= need:
        return None
    docs = f"{info['docs']:,} document{'s' if info['docs'] != 1 else ''}"
    shorter = "lower training.{} or training.seq_len"
    if split == "train":
        more = ("prepare more text into the folder (`kiln data prepare --input ...`)" if prepared
                else "raise data.max_bytes or use a larger data.source")
        return (f"the train split has {info['tokens']:,} tokens ({docs}), fewer than one global "
                f"batch needs: {global_batch} x {seq_len} + 1 = {need:,} tokens "
                f"(training.global_batch x training.seq_len + 1); {more}, or "
                f"{shorter.format('global_batch')}")
    micro = global_batch // world_size
    rows, keys = (f"{micro} x {world_size}", "training.micro_batch x data-parallel ranks") \
        if world_size > 1 else (str(micro), "training.micro_batch")
    now = meta.get("eval_fraction", "?")
    random = meta.get("eval_split", "random") == "random"
    fraction = suggest_eval_fraction(int(meta["total_tokens"]), need,
                                     num_docs=int(meta.get("num_docs", 0)) if random else 0,
                                     eval_docs=int(info["docs"]),
                                     now=now if isinstance(now, (int, float)) else None)
    if fraction is None:
        hold = f"the corpus ({int(meta['total_tokens']):,} tokens) is too small to hold out that"
        hold += " much: "
    elif prepared:
        hold = (f"hold out more documents (`kiln data prepare ... --eval-fraction {fraction}` "
                f"into a new --out folder; this one has {now}), ")
    else:
        hold = f"hold out more documents (data.eval_fraction = {fraction}; now {now}), "
    return (f"the eval split has {info['tokens']:,} tokens ({docs}), fewer than one evaluation "
            f"batch needs: {rows} x {seq_len} + 1 = {need:,} tokens ({keys} x "
            f"training.seq_len + 1); {hold}{shorter.format('micro_batch')}, or turn evaluation "
            "off (eval.interval = 0 and eval.at_end = false)")


def suggest_eval_fraction(total_tokens: int, need: int, *, num_docs: int = 0,
                          eval_docs: int = 0, now: float | None = None) -> float | None:
    """A share of documents to hold out that should give ``need`` eval tokens (a quarter more,
    for documents of uneven length), above the current share ``now``; with ``num_docs`` (a
    random split of whole documents) at least one document more than the ``eval_docs`` held out
    now, since a split of a few documents can fall short of the average by chance. None when
    that is half the corpus or more."""
    share = need / max(total_tokens, 1) * 1.25
    if num_docs:
        share = max(share, (eval_docs + 1) / num_docs)
    share = math.ceil(round(share * 100, 6)) / 100
    if now is not None and share <= now:
        share = math.floor(round(now * 100, 6)) / 100 + 0.01
    share = round(share, 2)
    return share if share < 0.5 else None

"""Which tokens of a rendered conversation are trained on: exactly the assistant's, or a clear
error.

The assistant's text is located two ways. A template with ``{% generation %}`` marks it while
rendering (what ``apply_chat_template(..., return_assistant_tokens_mask=True)`` reads). Most
stock templates lack the tag, so kiln renders prefixes: the conversation up to turn ``i`` with
the generation prompt, and up to and including turn ``i``; the assistant's span is what the
second adds to the first (its text and end-of-turn marker). That is exact only when each
rendering is a prefix of the next, which kiln checks; where it fails (a template that moves the
system prompt into the last user turn, say) the run stops naming the template and the example,
never falling back to training on the whole text.

Characters map to tokens through the tokenizer's offsets (a token is trained on when its text
overlaps a span, as transformers maps them); a tokenizer without offsets is encoded span by
span and the result checked against encoding the whole text.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from kiln.components.errors import DataError
from kiln.components.tokenizers.chat_templates import ChatTemplate

TrainOn = Literal["assistant", "last_assistant", "all"]
Span = tuple[int, int]


def assistant_spans(template: ChatTemplate, messages: list[dict[str, str]],
                    where: str) -> tuple[str, list[list[Span]]]:
    """(rendered text, the character spans of every assistant turn, in order: one list per
    turn; a template may mark a turn with several ``{% generation %}`` blocks)."""
    text, marked = template.render(messages, where=where)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if template.has_generation:
        return text, _marked_turns(template, messages, turns, marked, where)
    spans = []
    for i in turns:
        before, _ = template.render(messages[:i], add_generation_prompt=True, where=where)
        upto, _ = template.render(messages[:i + 1], where=where)
        if not (upto.startswith(before) and text.startswith(upto)):
            raise DataError(
                f"chat template {template.name}: the assistant turn {i} of {where} cannot be "
                "located exactly (rendering the conversation up to that turn is not a prefix "
                "of rendering it whole, so the template rewrites earlier turns); use a "
                "template with {% generation %} blocks or another template (data.template)")
        spans.append([(len(before), len(upto))])
    return text, spans


def _marked_turns(template: ChatTemplate, messages: list[dict[str, str]], turns: list[int],
                  marked: list[Span], where: str) -> list[list[Span]]:
    """The ``{% generation %}`` spans grouped by assistant turn: the spans a render up to and
    including a turn marks are that turn's and the earlier turns' (a template may mark a turn
    with several blocks: one around the content, one around the end-of-turn token).
    Training on every assistant turn takes their union, as ``transformers``'
    ``return_assistant_tokens_mask`` does."""
    if not turns:
        return []
    if len(turns) == 1 and marked:
        return [marked]
    counts = [len(template.render(messages[:i + 1], where=where)[1]) for i in turns[:-1]]
    edges = [0, *counts, len(marked)]
    if any(
            b <= a for a, b in zip(edges, edges[1:], strict=False)):
        raise DataError(
            f"chat template {template.name}: its {{% generation %}} blocks mark "
            f"{len(marked)} spans in {where}, which has {len(turns)} assistant turns, and they "
            "cannot be assigned to the turns (each turn needs at least one, and rendering the "
            "conversation up to a turn must mark that turn's and the earlier ones); fix the "
            "template's generation blocks")
    return [marked[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def chosen(spans: list[list[Span]], text: str, train_on: TrainOn) -> list[Span]:
    if train_on == "all":
        return [(0, len(text))]
    turns = spans[-1:] if train_on == "last_assistant" else spans
    return [span for turn in turns for span in turn]


def token_offsets(tokenizer: Any, text: str, cuts: list[int],
                  where: str) -> tuple[np.ndarray, np.ndarray]:
    """(bare token ids of ``text``, each token's character start and end (n, 2))."""
    if hasattr(tokenizer, "encode_offsets"):
        ids, offsets = tokenizer.encode_offsets(text)
        return np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    # No offsets: encode the pieces between span edges; exact only if that equals the whole.
    edges = sorted({0, len(text), *cuts})
    ids, offsets = [], []
    for a, b in zip(edges, edges[1:], strict=False):
        piece = tokenizer.encode(text[a:b], bos=False, eos=False)
        ids += piece
        offsets += [(a, b)] * len(piece)
    if ids != tokenizer.encode(text, bos=False, eos=False):
        raise DataError(f"{where}: the {type(tokenizer).__name__} merges tokens across the "
                        "edges of assistant turns, so they cannot be located exactly; use a "
                        "tokenizer with offsets (huggingface, bpe, byte)")
    return np.asarray(ids, dtype=np.int64), np.asarray(offsets, dtype=np.int64).reshape(-1, 2)


def encode(template: ChatTemplate, tokenizer: Any, messages: list[dict[str, str]],
           train_on: TrainOn, where: str, *, bos: bool) -> tuple[np.ndarray, np.ndarray]:
    """(token ids (n,), trained-on flags (n,)) of one conversation; ``bos``: start with the
    tokenizer's BOS (named templates: a Hugging Face template writes its own)."""
    text, spans = assistant_spans(template, messages, where)
    return trained_tokens(template, tokenizer, text, chosen(spans, text, train_on), where,
                          bos=bos, what="an assistant turn")


def trained_tokens(template: ChatTemplate, tokenizer: Any, text: str, spans: list[Span],
                   where: str, *, bos: bool, what: str) -> tuple[np.ndarray, np.ndarray]:
    """(token ids (n,), trained-on flags (n,)) of rendered ``text``: a token is trained on
    when its text overlaps a span; ``bos`` puts the tokenizer's BOS first; no trained token is
    an error naming ``what`` should have been trained."""
    ids, offsets = token_offsets(tokenizer, text, [e for s in spans for e in s], where)
    mask = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        mask |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    if bos:
        ids, mask = np.concatenate([[tokenizer.bos_id], ids]), np.concatenate([[False], mask])
    if not mask.any():
        raise DataError(f"{where}: no token of {what} after rendering with {template.name}; "
                        "check the template and the row")
    return ids, mask

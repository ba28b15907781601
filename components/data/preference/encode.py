"""A preference pair into two token rows whose loss covers the completion only.

Each side is rendered as the chat data renders a conversation (``chat/masks.py``): the prompt's
messages and then the side's completion, with the template; the trained tokens are those of
the completion's assistant turns (their text and end-of-turn marker), never the prompt's. Both
sides must give the prompt the same tokens, which is checked, so the two log-probabilities
differ by their completions only.

A side longer than ``seq_len + 1`` tokens follows the ``overlong`` policy for the pair as a
whole: ``"truncate"`` cuts both sides to the row (the prompt is kept, the completions lose
their ends; a pair left without a trained token on either side is dropped), ``"drop"`` leaves
the pair out, ``"error"`` stops naming the row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.components.data.chat import masks
from kiln.components.data.chat.packing import Overlong
from kiln.components.data.preference.pairs import SIDES, Pair
from kiln.components.errors import DataError
from kiln.components.tokenizers.chat_templates import ChatTemplate

Side = tuple[np.ndarray, np.ndarray]  # (token ids (n,), trained flags (n,))


@dataclass
class PairStats:
    pairs: int = 0
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0  # tokens of both sides placed in rows (padding not counted)
    trained: int = 0  # of those, completion tokens the log-probabilities sum over
    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def encode_side(template: ChatTemplate, tokenizer: Any, prompt: list, completion: list,
                where: str, *, bos: bool) -> Side:
    """One side's tokens and its completion-only mask."""
    messages = prompt + completion
    text, spans = masks.assistant_spans(template, messages, where)
    in_prompt = sum(m["role"] == "assistant" for m in prompt)
    spans = [span for turn in spans[in_prompt:] for span in turn]
    return masks.trained_tokens(template, tokenizer, text, spans, where, bos=bos,
                                what="the completion")


def encode_pair(template: ChatTemplate, tokenizer: Any, pair: Pair, where: str, *,
                bos: bool) -> tuple[Side, Side]:
    """(chosen, rejected), checked to share the prompt's tokens exactly."""
    sides = [encode_side(template, tokenizer, pair.prompt, getattr(pair, s), f"{where}: {s}",
                         bos=bos) for s in SIDES]
    (a, ma), (b, mb) = sides
    start_a, start_b = int(np.argmax(ma)), int(np.argmax(mb))
    if start_a != start_b or not np.array_equal(a[:start_a], b[:start_b]):
        raise DataError(f"{where}: chosen and rejected render the prompt to different tokens "
                        "(the template or tokenizer merges the prompt with the completion); "
                        "use another template (data.template) or tokenizer")
    return sides[0], sides[1]


def fit_pair(pair: tuple[Side, Side], width: int, policy: Overlong, where: str,
             stats: PairStats) -> tuple[Side, Side] | None:
    """The pair as it goes into rows of ``width`` tokens, or None when dropped."""
    stats.pairs += 1
    if all(len(ids) <= width for ids, _ in pair):
        return pair
    longest = max(len(ids) for ids, _ in pair)
    if policy == "error":
        raise DataError(f"{where}: a side of {longest} tokens, longer than training.seq_len + 1 "
                        f"= {width}; raise seq_len, or set data.overlong = \"truncate\" or "
                        "\"drop\"")
    if policy == "truncate" and all(mask[1:width].any() for _, mask in pair):
        stats.truncated += 1
        return (pair[0][0][:width], pair[0][1][:width]), (pair[1][0][:width], pair[1][1][:width])
    stats.dropped += 1
    return None


def rows(pairs: list[tuple[Side, Side]], width: int, pad_id: int,
         stats: PairStats) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens int32, trained bool, docs int32), each (2 * pairs, width): row ``2i`` the chosen
    side of pair ``i``, row ``2i + 1`` its rejected side; padding is a document of its own
    (docs 1), never trained on."""
    n = 2 * len(pairs)
    tokens = np.full((n, width), pad_id, dtype=np.int32)
    trained = np.zeros((n, width), dtype=bool)
    docs = np.ones((n, width), dtype=np.int32)
    for r, (ids, mask) in enumerate(side for pair in pairs for side in pair):
        tokens[r, :len(ids)], trained[r, :len(ids)], docs[r, :len(ids)] = ids, mask, 0
        stats.tokens += len(ids)
        stats.trained += int(mask[1:].sum())
    return tokens, trained, docs

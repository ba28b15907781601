"""The prompt set kiln builds itself, so an RL recipe runs offline: arithmetic questions with
their answers.

The prompts are the first turns of the chat set's dialogues (``chat/builtin.py``: "What is 47
times 22?", some with its system prompt); each row carries what a reward checks: ``answer``
(the value, "1034"), ``restated`` (the question as the SFT answers restate it, "47 * 22"),
and the operands ``a``, ``b`` and operator ``op``.
"""

from __future__ import annotations

import numpy as np

from kiln.components.data.chat.builtin import OPS, question


def prompts(n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"prompt": [...], "answer": ..., ...}``, the same for the same ``seed``."""
    rng = np.random.default_rng([seed, 0x6B0])
    rows = []
    for _ in range(n):
        prompt, a, b, op = question(rng)
        rows.append({"prompt": prompt, "answer": str(OPS[op][1](a, b)), "restated": f"{a} {op} {b}",
                     "a": str(a), "b": str(b), "op": op})
    return rows

"""The preference set kiln builds itself, so a preference recipe runs offline: arithmetic
questions with a right and a wrong answer.

The prompts are the first turns of the chat set's dialogues (``chat/builtin.py``: "What is 47
times 22?", some with its system prompt). The chosen answer restates the question and gives
the value ("47 * 22 = 1034."); the rejected one makes a mistake a small model makes: the wrong
operator (half the pairs), or a value off by a little. So a model tuned on these pairs learns
to prefer the restatement the in-loop ``exact_match`` task scores.
"""

from __future__ import annotations

import numpy as np

from kiln.components.data.chat.builtin import OPS, SYSTEM


def pairs(n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"prompt": [...], "chosen": "...", "rejected": "..."}``, the same for the
    same ``seed``."""
    rng = np.random.default_rng([seed, 0xD90])
    rows = []
    for _ in range(n):
        prompt = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
        a, b = (int(x) for x in rng.integers(2, 60, size=2))
        op = str(rng.choice(list(OPS)))
        word, fn = OPS[op]
        prompt.append({"role": "user", "content": f"What is {a} {word} {b}?"})
        if rng.random() < 0.5:
            wrong = str(rng.choice([o for o in OPS if o != op]))
            rejected = f"{a} {wrong} {b} = {OPS[wrong][1](a, b)}."
        else:
            off = int(rng.choice([-1, 1])) * int(rng.integers(1, 10))
            rejected = f"{a} {op} {b} = {fn(a, b) + off}."
        rows.append({"prompt": prompt, "chosen": f"{a} {op} {b} = {fn(a, b)}.",
                     "rejected": rejected})
    return rows

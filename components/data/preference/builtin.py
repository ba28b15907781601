"""The preference set kiln builds itself, so a preference recipe runs offline: arithmetic
questions with a right and a wrong answer.

The prompts are the first turns of the chat set's dialogues (``chat/builtin.py``: "What is 47
times 22?", some with its system prompt). The chosen answer restates the question and gives
the value ("47 * 22 = 1034."); the rejected one makes a mistake the SFT model makes: half the
time it copies an operand wrongly (and computes with it), else it takes the wrong operator or
gets the value a little wrong. A model tuned on these pairs learns to restate the question
exactly, which the in-loop ``exact_match`` task of ``dpo_debug.toml`` scores.
"""

from __future__ import annotations

import numpy as np

from kiln.components.data.chat.builtin import OPS, question


def pairs(n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"prompt": [...], "chosen": "...", "rejected": "..."}``, the same for the
    same ``seed``."""
    rng = np.random.default_rng([seed, 0xD90])
    rows = []
    for _ in range(n):
        prompt, a, b, op = question(rng)
        fn = OPS[op][1]
        kind = rng.random()
        if kind < 0.5:  # an operand miscopied, the value computed from it
            off = int(rng.choice([-1, 1])) * int(rng.integers(1, 10))
            x, y = (a + off, b) if rng.random() < 0.5 else (a, b + off)
            rejected = f"{x} {op} {y} = {fn(x, y)}."
        elif kind < 0.75:  # the wrong operator
            wrong = str(rng.choice([o for o in OPS if o != op]))
            rejected = f"{a} {wrong} {b} = {OPS[wrong][1](a, b)}."
        else:  # the value a little off
            off = int(rng.choice([-1, 1])) * int(rng.integers(1, 10))
            rejected = f"{a} {op} {b} = {fn(a, b) + off}."
        rows.append({"prompt": prompt, "chosen": f"{a} {op} {b} = {fn(a, b)}.",
                     "rejected": rejected})
    return rows

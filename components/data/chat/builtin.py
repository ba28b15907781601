"""The chat set kiln builds itself, so a fine-tuning recipe runs offline: arithmetic dialogues.

Each conversation asks for a sum, difference or product of small numbers and follows up for
one or two more turns on the previous answer ("And times 3?"); some start with a system
prompt. The answers are exact and follow one format, so a small model's assistant-token loss
falls visibly within a few hundred steps, while the user turns (not trained on) stay as hard
as random digits.
"""

from __future__ import annotations

import numpy as np

OPS = {"+": ("plus", lambda a, b: a + b), "-": ("minus", lambda a, b: a - b),
        "*": ("times", lambda a, b: a * b)}
SYSTEM = "You are a calculator."


def conversations(n: int, seed: int) -> list[dict]:
    """``n`` rows ``{"messages": [...]}``, the same for the same ``seed``."""
    rng = np.random.default_rng([seed, 0x5F7])
    rows = []
    for _ in range(n):
        messages = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
        a, b = (int(x) for x in rng.integers(2, 60, size=2))
        op = str(rng.choice(list(OPS)))
        value = OPS[op][1](a, b)
        messages += [{"role": "user", "content": f"What is {a} {OPS[op][0]} {b}?"},
                     {"role": "assistant", "content": f"{a} {op} {b} = {value}."}]
        for _ in range(int(rng.integers(0, 3))):
            op = str(rng.choice(list(OPS)))
            c = int(rng.integers(2, 10))
            new = OPS[op][1](value, c)
            messages += [{"role": "user", "content": f"And {OPS[op][0]} {c}?"},
                         {"role": "assistant", "content": f"{value} {op} {c} = {new}."}]
            value = new
        rows.append({"messages": messages})
    return rows


def question(rng: np.random.Generator) -> tuple[list[dict], int, int, str]:
    """A first turn of the set: (the prompt's messages, some with the system prompt; the
    operands; the operator), drawn from ``rng`` (the preference and prompt sets use it)."""
    prompt = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.3 else []
    a, b = (int(x) for x in rng.integers(2, 60, size=2))
    op = str(rng.choice(list(OPS)))
    prompt.append({"role": "user", "content": f"What is {a} {OPS[op][0]} {b}?"})
    return prompt, a, b, op

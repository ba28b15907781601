"""Shipped presets: the field map and prompt format of common tasks' Hugging Face files, so a
table only names the file (``preset = "arc"``, ``path = ".../test-00000-of-00001.parquet"``).
Keys a table sets win over the preset's. Prompts follow lm-evaluation-harness's task YAMLs;
differences are listed in ``about`` (and docs/evaluation.md)."""

from __future__ import annotations

from typing import Any

PRESETS: dict[str, dict[str, Any]] = {
    "hellaswag": {
        "type": "multiple_choice",
        "about": "Rowan/hellaswag (validation split); harness `hellaswag`, except that ctx_b is "
                 "not capitalised (the file's ctx is used as it is)",
        "fields": {"context": "ctx", "choices": "endings", "answer": "label"},
        "template": "{activity_label}: {context}",
        "markup": "wikihow",
    },
    "arc": {
        "type": "multiple_choice",
        "about": "allenai/ai2_arc ARC-Easy / ARC-Challenge; harness `arc_easy` / "
                 "`arc_challenge`",
        "fields": {"context": "question", "choices": "choices.text", "labels": "choices.label",
                   "answer": "answerKey"},
        "template": "Question: {context}\nAnswer:",
    },
    "openbookqa": {
        "type": "multiple_choice",
        "about": "allenai/openbookqa (main); harness `openbookqa`",
        "fields": {"context": "question_stem", "choices": "choices.text",
                   "labels": "choices.label", "answer": "answerKey"},
        "template": "{context}",
    },
    "piqa": {
        "type": "multiple_choice",
        "about": "ybisk/piqa (goal, sol1, sol2, label); harness `piqa`",
        "fields": {"context": "goal", "choices": ["sol1", "sol2"], "answer": "label"},
        "template": "Question: {context}\nAnswer:",
    },
    "mmlu": {
        "type": "multiple_choice",
        "about": "cais/mmlu (question, choices, answer); harness `mmlu_*`: the options listed "
                 "as A. .. D., the letter scored",
        "fields": {"context": "question", "choices": "choices", "answer": "answer"},
        "template": "{context}\n{options}\nAnswer:",
        "score_letters": True,
    },
    "gsm8k": {
        "type": "exact_match",
        "about": "openai/gsm8k (main); harness `gsm8k` strict-match: the number after '####'",
        "fields": {"prompt": "question", "answer": "answer"},
        "template": "Question: {prompt}\nAnswer:",
        "answer_regex": r"#### (\-?[0-9\.\,]+)",
        "extract_regex": r"#### (\-?[0-9\.\,]+)",
        "ignore": [",", r"\$", r"\.$"],
        "stop": ["Question:", "</s>", "<|im_end|>"],
        "max_new_tokens": 256,
    },
    "wikitext": {
        "type": "bits_per_byte",
        "about": "wikitext-style documents, one per row in a `page` field; harness `wikitext` "
                 "bits_per_byte",
        "fields": {"text": "page"},
    },
}


def get(name: str) -> dict[str, Any]:
    if name not in PRESETS:
        from kiln.components.registry import did_you_mean

        raise ValueError(f"unknown preset {name!r}{did_you_mean(name, list(PRESETS))}; "
                         f"presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]

"""The ``prompts`` dataset: each prompt rendered with the template and its generation prompt
exactly as ``kiln eval``'s chat tasks render it (named and Hugging Face templates), the other
fields kept for rewards (never pickled), batches of prompts with their stored rows, field
mapping, the overlong policies, bad rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.components.data.prompts.dataset import PromptConfig, PromptDataset
from kiln.components.errors import DataError
from kiln.components.tokenizers import chat_templates as templates
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer
from kiln.components.tokenizers.hf_tokenizer import HuggingFaceTokenizer, HuggingFaceTokenizerConfig

ROWS = [
    {"prompt": "What is 2 plus 3?", "answer": "5", "level": 1},
    {"prompt": [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Name a prime."}], "answer": "7", "level": 2},
    {"prompt": "Spell cat.", "answer": "c-a-t", "level": 1, "meta": {"nested": True}},
]


def _dataset(tmp_path, rows=ROWS, tokenizer=None, seq_len=96, **values):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = PromptConfig(type="prompts", path=str(path), cache_dir=str(tmp_path / "cache"),
                       **{"template": "chatml", "eval_fraction": 0, **values})
    ds = PromptDataset(cfg, tokenizer=tokenizer or ByteTokenizer(), seq_len=seq_len, seed=0)
    ds.prepare()
    return ds


@pytest.mark.parametrize("template", ["chatml", "llama3", "qwen2_5"])
def test_prompts_render_as_the_chat_tasks_render_them(tmp_path, hf_folders, template):
    if template == "chatml":
        tok, spec = ByteTokenizer(), "chatml"
    else:
        tok = HuggingFaceTokenizer(HuggingFaceTokenizerConfig(
            type="huggingface", path=str(hf_folders[template])))
        spec = ""
    ds = _dataset(tmp_path, tokenizer=tok, seq_len=200, template=spec)
    batch = next(iter(ds.loader("train", micro_batch=3, global_batch=3)))
    assert set(batch) == {"prompt_ids", "prompt_lengths", "rows"}
    fields = ds.prompt_fields("train", batch["rows"].tolist())
    by_answer = {r["answer"]: r for r in ROWS}
    for ids, n, f in zip(batch["prompt_ids"].tolist(), batch["prompt_lengths"].tolist(), fields,
                         strict=True):
        row = by_answer[f["answer"]]
        messages = row["prompt"] if isinstance(row["prompt"], list) else \
            [{"role": "user", "content": row["prompt"]}]
        assert ids[:n] == templates.prompt_ids(ds.template, tok, messages)
        assert all(t == ds.pad_id for t in ids[n:])
        # scalar fields are kept for the rewards; the prompt and nested values are not
        assert f == {k: v for k, v in row.items() if k in ("answer", "level")}
    assert ds.field_names == ["answer", "level"]  # those every prompt has
    assert "3 train prompts, 0 held out" in ds.describe()
    assert all(np.load(p, allow_pickle=False) is not None for p in ds.folder.glob("*.npy"))


def test_field_mapping_and_a_system_prompt(tmp_path):
    rows = [{"question": "Why?", "sys": "Be kind.", "gold": "because"}]
    ds = _dataset(tmp_path, rows, fields={"prompt": "question", "system": "sys"})
    batch = next(iter(ds.loader("train", micro_batch=1, global_batch=1)))
    text = ByteTokenizer().decode(batch["prompt_ids"][0, :batch["prompt_lengths"][0]].tolist())
    assert text.startswith("<|im_start|>system\nBe kind.") and "user\nWhy?" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert ds.prompt_fields("train", [0]) == [{"gold": "because"}]


def test_overlong_prompts_follow_the_policy_with_counts(tmp_path):
    rows = [{"prompt": "x" * 200, "answer": "1"}, {"prompt": "short", "answer": "2"}]
    with pytest.raises(DataError, match="line 1: the prompt is .* longer than training.seq_len"):
        _dataset(tmp_path / "e", rows, seq_len=64)
    dropped = _dataset(tmp_path / "d", rows, seq_len=64, overlong="drop")
    assert "1 train prompts" in dropped.describe() and "1 dropped" in dropped.describe()
    cut = _dataset(tmp_path / "t", rows, seq_len=64, overlong="truncate")
    assert "1 truncated" in cut.describe() and cut.longest_prompt == 64


@pytest.mark.parametrize("row, message", [
    ({"answer": "1"}, "prompt"),
    ({"prompt": 3, "answer": "1"}, "prompt must be text or a list of messages"),
    ({"prompt": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "must end with a user message"),
])
def test_bad_rows_name_the_file_and_row(tmp_path, row, message):
    with pytest.raises(DataError, match=f"prompts.jsonl: line 2: .*{message}"):
        _dataset(tmp_path, [ROWS[0], row])


def test_a_field_not_every_prompt_can_give_a_reward_is_traced_to_its_row(tmp_path):
    """What a reward naming a field is told: how many prompts have it and the first line
    without it, the line where it held a list or a table, or that none has it; and where each
    prompt came from, for a reward's own refusal of one (held-out prompts included)."""
    rows = [{"prompt": f"q{i}", "gold": i, "tags": ["a"] if i == 2 else "x"} for i in range(6)]
    del rows[3]["gold"]
    rows[4]["gold"] = None  # JSON null: no value
    ds = _dataset(tmp_path, rows, eval_fraction=0.5)
    assert ds.field_names == []  # tags is a list on line 3, gold missing on lines 4 and 5
    assert ds.field_problem("gold") == ("which 4 of the 6 prompts have; the first without it: "
                                        f"{tmp_path / 'prompts.jsonl'}: line 4")
    assert ds.field_problem("tags") == (f"which {tmp_path / 'prompts.jsonl'}: line 3 holds as "
                                        "a list or a table (a reward reads text, numbers and "
                                        "booleans)")
    assert ds.field_problem("nope") == "which no prompt has (every prompt has: none)"
    lines = {f"{tmp_path / 'prompts.jsonl'}: line {i + 1}": f"q{i}" for i in range(6)}
    for split in ("train", "eval"):
        for row in range(ds.prompt_count(split)):
            text = ByteTokenizer().decode(ds.prompt_ids(split, [row])[0])
            assert f"user\n{lines.pop(ds.prompt_where(split, row))}<" in text
    assert not lines  # every line once, in one split or the other
    # the checksum the resume check compares is the rows' alone (as before kiln kept where
    # they came from): a cache entry written by an older kiln resumes with the same fingerprint
    import xxhash

    meta, rows_sum = json.loads((ds.folder / "meta.json").read_text()), xxhash.xxh3_128()
    for split in meta["splits"]:
        for name in ("prompts", "lengths", "fields"):
            array = np.load(ds.folder / f"{split}_{name}.npy", allow_pickle=False)
            rows_sum.update(np.ascontiguousarray(array).view(np.uint8))
    assert rows_sum.hexdigest() == meta["rows_xxh3"]


def test_the_builtin_prompts_carry_their_answers(tmp_path):
    cfg = PromptConfig(type="prompts", template="chatml", builtin_rows=20,
                       cache_dir=str(tmp_path / "cache"), eval_fraction=0.1)
    ds = PromptDataset(cfg, tokenizer=ByteTokenizer(), seq_len=160, seed=0)
    ds.prepare()
    assert ds.field_names == ["a", "answer", "b", "op", "restated"]
    for f in ds.prompt_fields("train", list(range(18))):
        a, op, b = f["restated"].split()
        assert (a, op, b) == (f["a"], f["op"], f["b"])
        assert int(f["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b),
                                    "*": int(a) * int(b)}[op]

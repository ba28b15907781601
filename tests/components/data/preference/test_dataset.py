"""The ``preference`` dataset: completion-only masks under named and Hugging Face templates
(with and without generation blocks), both sides sharing the prompt's tokens, batches of
chosen then rejected rows, the overlong policies with their counts, bad rows."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.components.data.preference.dataset import PreferenceConfig, PreferenceDataset
from kiln.components.errors import DataError
from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer
from kiln.components.tokenizers.hf_tokenizer import HuggingFaceTokenizer, HuggingFaceTokenizerConfig

ROWS = [
    {"prompt": "What is 2 plus 3?", "chosen": "2 + 3 = 5.", "rejected": "2 + 3 = 6."},
    {"prompt": [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Name a prime."}],
     "chosen": "Seven.", "rejected": "Nine, the only one."},
    {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "Again"}, {"role": "assistant", "content": "done"}],
     "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                  {"role": "user", "content": "Again"},
                  {"role": "assistant", "content": "no"}]},
]


PAIRS = [("2 + 3 = 5.", "2 + 3 = 6."), ("Seven.", "Nine, the only one."), ("done", "no")]
CONTENTS = sorted((c for pair in PAIRS for c in pair), key=len, reverse=True)


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _dataset(tmp_path, tokenizer=None, seq_len=160, rows=ROWS, **values):
    cfg = PreferenceConfig(type="preference", path=_write(tmp_path / "pairs.jsonl", rows),
                           cache_dir=str(tmp_path / "cache"), eval_fraction=0,
                           **{"template": "chatml", **values})
    ds = PreferenceDataset(cfg, tokenizer=tokenizer or ByteTokenizer(), seq_len=seq_len, seed=0)
    ds.prepare()
    return ds


def _completion_text(tokenizer, batch, row):
    labels = batch["labels"][row]
    return tokenizer.decode(labels[labels != IGNORE_INDEX].tolist())


def _prompt_ids(batch, row):
    labels = batch["labels"][row]
    start = int(np.argmax((labels != IGNORE_INDEX).numpy()))
    return batch["input_ids"][row, :start + 1].tolist()  # up to the first completion token


@pytest.mark.parametrize("template", ["chatml", "llama3", "qwen2_5", "chatml_generation"])
def test_only_completion_tokens_are_trained_and_both_sides_share_the_prompt(
        tmp_path, hf_folders, template):
    """Named ChatML on bytes; Hugging Face templates (rendered by prefixes, or marked with
    generation blocks) on a byte-level BPE."""
    if template == "chatml":
        tok, spec = ByteTokenizer(), "chatml"
    else:
        tok = HuggingFaceTokenizer(HuggingFaceTokenizerConfig(
            type="huggingface", path=str(hf_folders[template])))
        spec = ""
    ds = _dataset(tmp_path, tok, seq_len=256, template=spec)
    batch = ds.loader("train", micro_batch=3, global_batch=3).__next__()
    assert batch["input_ids"].shape == (6, 256)  # 3 chosen rows, then their 3 rejected rows
    texts = [_completion_text(tok, batch, r) for r in range(6)]
    contents = [next(c for c in CONTENTS if t.startswith(c)) for t in texts]
    # each row trains on its completion and the template's end of turn (the same for all)
    assert len({t[len(c):] for t, c in zip(texts, contents, strict=True)}) == 1
    assert sorted(contents[:3]) == sorted(c for c, _ in PAIRS)
    assert sorted(contents[3:]) == sorted(r for _, r in PAIRS)
    for r in range(3):  # pair r: chosen row r, rejected row r + 3, one prompt
        assert _prompt_ids(batch, r) == _prompt_ids(batch, r + 3)
        assert (contents[r], contents[r + 3]) in PAIRS
    assert "3 train pairs of 3" in ds.describe()


def test_the_loader_serves_pairs_whole_on_every_rank_and_resumes_by_seeking(tmp_path):
    rows = [{"prompt": f"Q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(12)]
    ds = _dataset(tmp_path, rows=rows)
    one = ds.loader("train", micro_batch=4, global_batch=4)
    halves = [ds.loader("train", micro_batch=2, global_batch=4, rank=r, world_size=2)
              for r in range(2)]
    whole, a, b = next(iter(one)), next(iter(halves[0])), next(iter(halves[1]))
    # the global batch's chosen rows are rank 0's then rank 1's, and so are the rejected ones
    for key in ("input_ids", "labels"):
        assert whole[key][:4].tolist() == a[key][:2].tolist() + b[key][:2].tolist()
        assert whole[key][4:].tolist() == a[key][2:].tolist() + b[key][2:].tolist()
    state = one.state_dict()
    following = next(one)
    again = ds.loader("train", micro_batch=4, global_batch=4)
    again.load_state_dict(state)
    assert next(again)["input_ids"].tolist() == following["input_ids"].tolist()


def test_overlong_pairs_follow_the_policy_with_counts(tmp_path):
    long = {"prompt": "Tell me", "chosen": "x" * 300, "rejected": "y"}
    rows = [*ROWS[:2], long]
    ds = _dataset(tmp_path / "t", rows=rows, overlong="truncate")
    t = ds.meta["splits"]["train"]
    assert (t["pairs"], t["truncated"], t["dropped"]) == (3, 1, 0)
    batch = next(iter(ds.loader("train", micro_batch=3, global_batch=3)))
    assert (batch["labels"] != IGNORE_INDEX).sum(-1).min() > 0
    ds = _dataset(tmp_path / "d", rows=rows, overlong="drop")
    t = ds.meta["splits"]["train"]
    assert (t["pairs"], t["truncated"], t["dropped"]) == (3, 0, 1)
    assert "2 train pairs of 3" in ds.describe() and "1 dropped" in ds.describe()
    with pytest.raises(DataError, match=r"pairs.jsonl: line 3: a side of \d+ tokens, longer"):
        _dataset(tmp_path / "e", rows=rows, overlong="error")
    with pytest.raises(DataError, match="every one of the 3 train pairs was dropped"):
        _dataset(tmp_path / "all", rows=rows, seq_len=16)


def test_bad_rows_name_the_file_and_line(tmp_path):
    rows = [ROWS[0], {"prompt": "q", "chosen": "same", "rejected": "same"}]
    with pytest.raises(DataError, match=r"pairs.jsonl: line 2: chosen equals rejected"):
        _dataset(tmp_path, rows=rows)


def test_the_built_in_pairs_prefer_the_right_answer(tmp_path):
    cfg = PreferenceConfig(type="preference", template="chatml", builtin_rows=40,
                           cache_dir=str(tmp_path / "cache"))
    ds = PreferenceDataset(cfg, tokenizer=ByteTokenizer(), seq_len=256, seed=0)
    ds.prepare()
    assert ds.meta["splits"]["train"]["truncated"] == 0
    tok = ByteTokenizer()
    batch = next(iter(ds.loader("train", micro_batch=8, global_batch=8)))
    for r in range(8):
        question = tok.decode(_prompt_ids(batch, r)).split("What is ")[1].split("?")[0]
        a, word, b = question.split()
        value = {"plus": int(a) + int(b), "minus": int(a) - int(b), "times": int(a) * int(b)}
        assert _completion_text(tok, batch, r).endswith(f"= {value[word]}.<|im_end|>")
        assert _completion_text(tok, batch, r + 8) != _completion_text(tok, batch, r)


def test_parquet_rows_with_mapped_fields_read_like_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": f"Q{i}", "good": f"yes {i}", "bad": f"no {i}"} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    cfg = PreferenceConfig(type="preference", path=str(tmp_path / "pairs.parquet"),
                           template="chatml", eval_fraction=0, cache_dir=str(tmp_path / "c"),
                           fields={"prompt": "question", "chosen": "good", "rejected": "bad"})
    ds = PreferenceDataset(cfg, tokenizer=ByteTokenizer(), seq_len=128, seed=0)
    ds.prepare()
    batch = next(iter(ds.loader("train", micro_batch=6, global_batch=6)))
    texts = {_completion_text(ByteTokenizer(), batch, r) for r in range(6)}
    assert texts == {f"yes {i}<|im_end|>" for i in range(6)}


@pytest.mark.parametrize("unpaired", [False, True])
def test_a_split_smaller_than_a_batch_counts_pairs_or_examples(tmp_path, unpaired):
    """The message counted "rows" where the split held pairs (a stored pair is two rows)."""
    rows = [{"prompt": f"Q{i}", "completion": f"A{i}", "label": True} if unpaired else
            {"prompt": f"Q{i}", "chosen": f"yes {i}", "rejected": f"no {i}"} for i in range(3)]
    ds = _dataset(tmp_path, rows=rows)
    unit = "examples" if unpaired else "pairs"
    with pytest.raises(DataError, match=rf"the train split holds 3 {unit}, fewer than one "
                       "global batch of 4"):
        ds.loader("train", micro_batch=4, global_batch=4)
    one = _dataset(tmp_path / "one", rows=rows[:1])
    with pytest.raises(DataError, match=rf"the train split holds 1 {unit[:-1]}, fewer"):
        one.loader("train", micro_batch=2, global_batch=2)


def test_unpaired_examples_carry_their_label_and_a_mismatched_row(tmp_path):
    """KTO's rows: each example, then its prompt with the next example's completion (in the
    split's stored order), and each example's label."""
    rows = [{"prompt": f"Q{i}", "completion": f"A{i}", "label": i % 3 == 0} for i in range(6)]
    ds = _dataset(tmp_path, rows=rows)
    assert ds.pairs == "unpaired" and "unpaired (KTO): 6 train examples" in ds.describe()
    tok = ByteTokenizer()
    batch = ds.pair_batch("train", np.arange(6))
    for r in range(6):
        prompt = tok.decode(_prompt_ids(batch, r))
        assert f"Q{r}" in prompt and _completion_text(tok, batch, r) == f"A{r}<|im_end|>"
        assert _prompt_ids(batch, r + 6) == _prompt_ids(batch, r)  # the same prompt
        assert _completion_text(tok, batch, r + 6) == f"A{(r + 1) % 6}<|im_end|>"
    assert batch["desirable"].tolist() == [i % 3 == 0 for i in range(6)]


@pytest.mark.parametrize("rows, message", [
    ([{"prompt": "q", "completion": "a", "label": True},
      {"prompt": "q", "chosen": "a", "rejected": "b"}], "line 2: a pair among unpaired"),
    ([{"prompt": "q", "completion": "a", "label": "yes"}], "label must be true"),
    ([{"prompt": "q", "completion": " ", "label": False}], "the completion is empty"),
])
def test_bad_unpaired_rows_name_the_line(tmp_path, rows, message):
    with pytest.raises(DataError, match=message):
        _dataset(tmp_path, rows=rows)

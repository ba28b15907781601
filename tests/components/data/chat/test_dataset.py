"""The ``chat`` dataset: packing with per-conversation documents and labels, the overlong
policies, the same global batch on 1 and 2 ranks, the cache, and damaged inputs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.components.data.chat import packing
from kiln.components.data.chat.dataset import ChatConfig, ChatDataset
from kiln.components.errors import DataError
from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer


def _conv(n: int, trained_from: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.arange(1, n + 1)
    mask = np.zeros(n, dtype=bool)
    mask[trained_from:] = True
    return ids, mask


def test_packing_keeps_conversations_apart_and_masks_padding():
    stats = packing.PackStats()
    a, b, c = _conv(4, 2), _conv(3, 1), _conv(5, 3)
    tokens, trained, docs = packing.pack([a, b, c], 8, packed=True, pad_id=0, stats=stats)
    assert tokens.tolist() == [[1, 2, 3, 4, 1, 2, 3, 0], [1, 2, 3, 4, 5, 0, 0, 0]]
    assert docs.tolist() == [[0, 0, 0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 1, 1, 1]]
    labels, keep = packing.labels_of(tokens, trained, docs)
    # row 0: conversation a trains its tokens 3, 4; b its tokens 2, 3 (not its first: new doc)
    assert labels[0].tolist() == [IGNORE_INDEX, 3, 4, IGNORE_INDEX, 2, 3, IGNORE_INDEX]
    assert stats.rows == 2 and stats.tokens == 12 and stats.trained == keep.sum() == 6
    one, _, _ = packing.pack([a, b], 8, packed=False, pad_id=0, stats=packing.PackStats())
    assert one.tolist() == [[1, 2, 3, 4, 0, 0, 0, 0], [1, 2, 3, 0, 0, 0, 0, 0]]


def test_overlong_conversations_follow_the_policy():
    stats = packing.PackStats()
    long = _conv(10, 4)
    kept = packing.fit(*long, 6, "truncate", "f: line 2", stats)
    assert kept is not None and len(kept[0]) == 6 and stats.truncated == 1
    assert packing.fit(*_conv(10, 8), 6, "truncate", "f: line 3", stats) is None  # nothing left
    assert packing.fit(*long, 6, "drop", "f: line 4", stats) is None
    assert (stats.dropped, stats.conversations) == (2, 3)
    with pytest.raises(DataError, match="f: line 5: 10 tokens, longer than training.seq_len "
                                        r"\+ 1 = 6; .*data.overlong"):
        packing.fit(*long, 6, "error", "f: line 5", stats)


def _dataset(tmp_path, **values) -> ChatDataset:
    cfg = ChatConfig(type="chat", template="chatml", cache_dir=str(tmp_path / "cache"),
                     builtin_rows=300, **values)
    return ChatDataset(cfg, tokenizer=ByteTokenizer(), seq_len=128, seed=3)


def test_one_and_two_ranks_see_the_same_global_batch(tmp_path):
    ds = _dataset(tmp_path)
    one = ds.loader("train", micro_batch=4, global_batch=8)
    two = [ds.loader("train", micro_batch=2, global_batch=8, rank=r, world_size=2)
           for r in (0, 1)]
    for _ in range(3):  # a step: 2 micro-batches of 4 rows, or 2 x 2 per rank
        whole = np.concatenate([next(one)["labels"].numpy() for _ in range(2)])
        halves = [np.concatenate([next(t)["labels"].numpy() for _ in range(2)]) for t in two]
        assert np.array_equal(whole, np.concatenate(halves))
    batch = next(one)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["doc_ids"].shape == (4, 128)
    assert ((batch["labels"] != IGNORE_INDEX).sum(1) > 0).all()  # every row trains something


def test_the_rows_are_built_once_and_resume_is_a_seek(tmp_path):
    ds = _dataset(tmp_path)
    folder = ds.prepare()
    stamp = (folder / "meta.json").stat().st_mtime_ns
    again = _dataset(tmp_path)
    assert again.prepare() == folder and (folder / "meta.json").stat().st_mtime_ns == stamp
    assert again.meta["template"]["name"] == "chatml" and again.meta["train_on"] == "assistant"
    loader = ds.loader("train", micro_batch=2, global_batch=4)
    [next(loader) for _ in range(6)]
    state = loader.state_dict()
    want = next(loader)["input_ids"]
    fresh = again.loader("train", micro_batch=2, global_batch=4)
    fresh.load_state_dict(json.loads(json.dumps(state)))
    assert np.array_equal(next(fresh)["input_ids"], want)
    assert _dataset(tmp_path, train_on="all").folder != folder  # another key, other rows


def test_the_eval_split_is_held_out_and_small_splits_say_what_to_do(tmp_path):
    ds = _dataset(tmp_path)
    ds.prepare()
    assert ds.meta["splits"]["eval"]["conversations"] == 15
    with pytest.raises(DataError,
                       match="fewer than one evaluation batch of 64.*eval_fraction.*micro_batch"):
        ds.loader("eval", micro_batch=64, global_batch=64)
    with pytest.raises(DataError, match=r"^the built-in rows \(prepared in .*cache.*\): the eval"):
        ds.loader("eval", micro_batch=64, global_batch=64)  # the source, then where it is kept


def test_bad_rows_and_damaged_folders_are_one_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "yo"}]}) + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl: line 2: no assistant turn"):
        _dataset(tmp_path, path=str(bad)).prepare()
    ds = _dataset(tmp_path)
    folder = ds.prepare()
    (folder / "train_tokens.npy").write_bytes(b"not numpy")
    with pytest.raises(DataError, match="damaged chat data.*delete the folder"):
        next(ds.loader("train", micro_batch=2, global_batch=4))


def test_empty_assistant_turns_are_kept_and_counted(tmp_path):
    """Policy: kept, trained on their end of turn only (as transformers masks them), and the
    start-up line counts them (they were accepted without a word)."""
    rows = [{"messages": [{"role": "user", "content": f"q{i}"},
                          {"role": "assistant", "content": "" if i % 3 == 0 else f"a{i}"}]}
            for i in range(30)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = _dataset(tmp_path, path=str(path), eval_fraction=0.0)
    ds.prepare()
    assert ds.meta["empty_assistant_turns"] == 10
    assert "; 10 empty assistant turns (trained on their end of turn only)" in ds.describe()
    full = _dataset(tmp_path, eval_fraction=0.0)
    full.prepare()
    assert "empty assistant" not in full.describe()

"""The held-out split does not follow training.seed: every seed of a recipe trains on the same
examples in its own order and is scored on the same held-out ones, so seed replicates compare
(`kiln compare`, `kiln sweep --seeds`). Older layouts keep their fingerprints; data that differs
has another eval fingerprint."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.components.data.chat.dataset import ChatConfig, ChatDataset
from kiln.components.data.preference.dataset import PreferenceConfig, PreferenceDataset
from kiln.components.data.prepare import packed_layout
from kiln.components.data.prompts.dataset import PromptConfig, PromptDataset
from kiln.components.data.streaming_text import StreamingText, StreamingTextConfig
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer
from tests.components.data.conftest import write_corpus


def test_packed_documents_hold_out_the_same_documents_for_every_seed(make_dataset):
    one, two = make_dataset(seed=0), make_dataset(seed=5)
    assert one.folder != two.folder  # the epochs' orders differ, so the folders do
    for name in ("doc_start", "doc_len"):
        assert np.array_equal(np.load(one.folder / "eval" / f"{name}.npy"),
                              np.load(two.folder / "eval" / f"{name}.npy"))
    assert not np.array_equal(np.load(one.folder / "epoch_0" / "doc_start.npy"),
                              np.load(two.folder / "epoch_0" / "doc_start.npy"))
    assert one.eval_fingerprints() == two.eval_fingerprints()
    assert one.fingerprints() != two.fingerprints()  # a resume still refuses another order
    assert two.meta["seed"] == 5 and two.meta["split_seed"] == 0


def test_other_documents_or_another_fraction_have_another_eval_fingerprint(make_dataset,
                                                                           tmp_path):
    base = make_dataset().eval_fingerprints()
    assert make_dataset(eval_fraction=0.2).eval_fingerprints() != base
    other = write_corpus(tmp_path / "other", seed=1)
    assert make_dataset(source_path=str(other)).eval_fingerprints() != base


def test_layouts_written_before_the_split_seed_keep_their_fingerprints():
    old = {"tokens_xxh3": "t", "total_tokens": 9, "num_docs": 3, "seed": 2, "num_epochs": 1,
           "eval_fraction": 0.1, "tokenizer": "byte", "vocab_size": 258,
           "splits": {"eval": {"docs": 1}}}
    same = {**old, "split_seed": 2}  # `kiln data prepare --seed 2`: the split is the seed's
    assert packed_layout.fingerprint(old) == packed_layout.fingerprint(same)
    assert packed_layout.eval_fingerprint(old) == packed_layout.eval_fingerprint(same)
    moved = {**old, "split_seed": 0}
    assert packed_layout.fingerprint(moved) != packed_layout.fingerprint(old)
    assert packed_layout.eval_fingerprint(moved) != packed_layout.eval_fingerprint(old)
    assert packed_layout.eval_fingerprint({**moved, "seed": 7}) == \
        packed_layout.eval_fingerprint(moved)  # the train order is not the held-out data
    tail = {**old, "eval_split": "tail"}  # no draw: the seed plays no part
    assert packed_layout.eval_fingerprint(tail) == \
        packed_layout.eval_fingerprint({**tail, "split_seed": 0})


def _rows_dataset(cls, config, tmp_path, seed):
    ds = cls(config(cache_dir=str(tmp_path / "cache"), template="chatml", builtin_rows=60,
                    eval_fraction=0.2), tokenizer=ByteTokenizer(), seq_len=128, seed=seed)
    ds.prepare()
    return ds


@pytest.mark.parametrize("cls,config", [
    (ChatDataset, lambda **v: ChatConfig(type="chat", **v)),
    (PreferenceDataset, lambda **v: PreferenceConfig(type="preference", **v)),
    (PromptDataset, lambda **v: PromptConfig(type="prompts", **v)),
], ids=["chat", "preference", "prompts"])
def test_built_in_rows_and_their_held_out_split_are_the_same_for_every_seed(cls, config,
                                                                             tmp_path):
    one, two = (_rows_dataset(cls, config, tmp_path, seed) for seed in (0, 3))
    assert one.folder == two.folder and one.eval_fingerprints() == two.eval_fingerprints()
    train = [ds.loader("train", micro_batch=4, global_batch=4) for ds in (one, two)]
    first = [next(loader) for loader in train]
    assert not all(np.array_equal(first[0][k], first[1][k]) for k in first[0])  # own order
    held = [next(ds.loader("eval", micro_batch=4, global_batch=4)) for ds in (one, two)]
    assert all(np.array_equal(held[0][k], held[1][k]) for k in held[0])


def test_streaming_text_tells_other_inputs_apart_by_their_held_out_tokens(tmp_path):
    def fingerprint(folder, eval_docs=4):
        cfg = StreamingTextConfig(type="streaming_text", inputs=[str(folder / "*.txt")],
                                  eval_docs=eval_docs)
        return StreamingText(cfg, tokenizer=ByteTokenizer(), seq_len=16).eval_fingerprints()

    a, b = write_corpus(tmp_path / "a"), write_corpus(tmp_path / "b", seed=1)
    assert fingerprint(a) == fingerprint(a) != fingerprint(b)
    assert fingerprint(a, eval_docs=5) != fingerprint(a)
    assert fingerprint(a, eval_docs=0) == {}

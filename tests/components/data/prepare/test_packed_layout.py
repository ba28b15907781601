from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.components.data.prepare.packed_layout import open_layout, split_documents, write_layout
from kiln.components.errors import DataError
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer

TEXTS = [f"document number {i} " * (1 + i % 5) for i in range(30)]


def build(folder, texts=TEXTS, seed=0, num_epochs=3, eval_fraction=0.2):
    return write_layout(folder, texts, ByteTokenizer(), seq_len=16, num_epochs=num_epochs,
                        seed=seed, eval_fraction=eval_fraction, source="test")


def test_written_layout_round_trips(tmp_path):
    tok = ByteTokenizer()
    layout = open_layout(build(tmp_path / "d"), tok)
    meta = layout.meta
    assert meta["layout_version"] == 1 and meta["vocab_size"] == 258 and meta["num_docs"] == 30
    assert meta["token_dtype"] == "uint16" and layout.tokens.dtype == np.uint16
    assert meta["splits"]["train"]["docs"] + meta["splits"]["eval"]["docs"] == 30
    for i, text in enumerate(TEXTS):
        doc = layout.tokens[layout.doc_offsets[i]:layout.doc_offsets[i + 1]]
        assert doc[0] == tok.bos_id and doc[-1] == tok.eos_id
        assert tok.decode(doc) == text
    assert not list(tmp_path.glob(".d.tmp-*"))  # the temporary folder is gone


def test_epochs_permute_train_docs_and_eval_is_disjoint(tmp_path):
    layout = open_layout(build(tmp_path / "d"))
    orders = [layout.order("train", e)[0] for e in range(3)]
    assert all(sorted(o) == sorted(orders[0]) for o in orders)
    assert not np.array_equal(orders[0], orders[1])
    assert np.array_equal(layout.order("train", 4)[0], orders[1])  # epochs cycle
    held_out = layout.order("eval")[0]
    assert len(held_out) == 6 and not set(held_out) & set(orders[0])


def test_seeded(tmp_path):
    a, b, c = (open_layout(build(tmp_path / n, seed=s)) for n, s in [("a", 1), ("b", 1), ("c", 2)])
    assert np.array_equal(a.order("train", 0)[0], b.order("train", 0)[0])
    assert not np.array_equal(a.order("train", 0)[0], c.order("train", 0)[0])
    train, held = split_documents(10, 0.0, 0)
    assert len(train) == 10 and len(held) == 0


def test_failed_build_leaves_nothing(tmp_path):
    def texts():
        yield "one"
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        build(tmp_path / "d", texts())
    assert list(tmp_path.iterdir()) == []


def test_no_documents_and_existing_folder(tmp_path):
    with pytest.raises(DataError, match="no documents"):
        build(tmp_path / "d", [])
    build(tmp_path / "e")
    with pytest.raises(DataError, match="already exists"):
        build(tmp_path / "e")


def _edit_meta(folder, **changes):
    meta = json.loads((folder / "metadata.json").read_text())
    meta.update(changes)
    (folder / "metadata.json").write_text(json.dumps(meta))


CORRUPTIONS = {
    "missing metadata": (lambda f: (f / "metadata.json").unlink(), "metadata.json is missing"),
    "missing tokens": (lambda f: (f / "tokens.bin").unlink(), "tokens.bin is missing"),
    "missing order": (lambda f: (f / "epoch_1" / "doc_len.npy").unlink(), "epoch_1/doc_len.npy"),
    "truncated tokens": (
        lambda f: (f / "tokens.bin").write_bytes((f / "tokens.bin").read_bytes()[:-2]),
        "tokens.bin is",
    ),
    "wrong version": (lambda f: _edit_meta(f, layout_version=2), "layout_version is 2"),
    "vocab mismatch": (lambda f: _edit_meta(f, vocab_size=50257), "tokenizer"),
    "token count": (lambda f: _edit_meta(f, total_tokens=5), "tokens.bin is"),
    "doc out of range": (
        lambda f: np.save(f / "eval" / "doc_start.npy",
                          np.load(f / "eval" / "doc_start.npy") + 10**9),
        "not documents",
    ),
    "garbled npy": (lambda f: (f / "doc_offsets.npy").write_bytes(b"junk"), "unreadable"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_corrupt_folder_is_a_data_error(tmp_path, name):
    folder = build(tmp_path / "d")
    corrupt, message = CORRUPTIONS[name]
    corrupt(folder)
    with pytest.raises(DataError, match=message) as err:
        open_layout(folder, ByteTokenizer())
    assert str(folder) in str(err.value)
    assert "kiln data prepare" in str(err.value)


def test_missing_folder(tmp_path):
    with pytest.raises(DataError, match=r"kiln data prepare .*--input .*--out"):
        open_layout(tmp_path / "nope")
    (tmp_path / "text.jsonl").write_text('{"text": "a"}\n')  # the text itself, not a folder
    with pytest.raises(DataError, match=r"text.jsonl is a file.*--input .*text.jsonl --out"):
        open_layout(tmp_path / "text.jsonl")
    # a folder of the user's text: it said "not a valid packed-document layout ... delete it"
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("text")
    with pytest.raises(DataError, match=r"corpus holds no prepared dataset \(no metadata.json, "
                                        r"tokens.bin or doc_offsets.npy\).*--input .*corpus "
                                        r"--out FOLDER") as err:
        open_layout(tmp_path / "corpus")
    assert "delete" not in str(err.value)


def _plant(folder, value=300):
    """Write ``value`` (beyond the byte tokenizer's 258 ids) over every 'o' in tokens.bin:
    a damaged file, or one written by another tokenizer."""
    tokens = np.memmap(folder / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[tokens == ord("o")] = value
    tokens.flush()


def test_a_layout_records_its_largest_id(tmp_path):
    meta = open_layout(build(tmp_path / "d")).meta
    assert meta["max_id"] == 257  # EOS: the byte tokenizer's last id


def test_a_recorded_id_beyond_the_vocabulary_fails_at_open(tmp_path):
    folder = build(tmp_path / "d")
    _edit_meta(folder, max_id=300)
    with pytest.raises(DataError, match="token ids up to 300, beyond the vocabulary of 258") as err:
        open_layout(folder)
    assert str(folder) in str(err.value) and "kiln data prepare" in str(err.value)


@pytest.mark.parametrize("workers", [0, 1])
@pytest.mark.parametrize("recorded", [True, False], ids=["max_id recorded", "older folder"])
def test_ids_beyond_the_vocabulary_fail_the_batch_that_reads_them(tmp_path, recorded, workers):
    """The recorded max_id is checked at open; each batch is checked too (tokens.bin changed
    after it was written, or a folder from before max_id was recorded), in a loader worker
    too (the message arrives without torch's traceback text)."""
    from kiln.components.data.packed_loader import Loader

    folder = build(tmp_path / "d")
    _plant(folder)
    if not recorded:
        meta = json.loads((folder / "metadata.json").read_text())
        del meta["max_id"]
        (folder / "metadata.json").write_text(json.dumps(meta))
    for split in ("train", "eval"):
        loader = Loader(open_layout(folder), split, seq_len=16, micro_batch=2, global_batch=2,
                        rank=0, world_size=1, num_workers=workers)
        with pytest.raises(DataError, match="token id 300 .*258 ids") as err:
            next(iter(loader))
        assert str(err.value).startswith(f"dataset folder {folder}: token id 300")
        assert "kiln data info" in str(err.value) and "Traceback" not in str(err.value)


def test_a_tokenizer_that_gives_ids_beyond_its_vocabulary_fails_the_build(tmp_path):
    class Overflowing(ByteTokenizer):
        def encode_batch(self, texts):
            out = super().encode_batch(texts)
            out[0][0] = 300
            return out

    with pytest.raises(DataError, match=r"token id 300 \(token 1 of tokens.bin\) .*258 ids\); "
                                        "the tokenizer gave ids beyond its own vocab_size"):
        write_layout(tmp_path / "d", TEXTS, Overflowing(), seq_len=16, num_epochs=1, seed=0,
                     eval_fraction=0.2, source="test")
    assert list(tmp_path.iterdir()) == []

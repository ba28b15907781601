"""sentencepiece (.model trained in the test) and tiktoken (a ranks file made from a BPE trained
in the test): ids, specials, round trips, pickling, and the errors for bad files."""

from __future__ import annotations

import pickle

import pytest

from kiln.components.base import default_config
from kiln.components.errors import RecipeError
from tests.components.tokenizers.tokenizer_files import (
    sentencepiece_model,
    stdlib_texts,
    tiktoken_ranks,
    trained_tokenizer,
)

TEXT = "def f(x):\n    return x + 1  # naïve — 日本語\n"


def test_sentencepiece(tmp_path):
    pytest.importorskip("sentencepiece")
    path = sentencepiece_model(tmp_path / "sp")
    tok = default_config("tokenizer", "sentencepiece", path=str(path)).build()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (700, 1, 2, 3)
    ids = tok.encode(TEXT)
    assert ids[0] == tok.bos_id and tok.decode(ids) == TEXT  # byte fallback: nothing lost
    batch = tok.encode_batch(list(stdlib_texts()[:2]))
    assert [b.tolist() for b in batch] == [tok.encode(t, bos=False) for t in stdlib_texts()[:2]]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(TEXT) == ids and clone.fingerprint() == tok.fingerprint()
    assert default_config("tokenizer", "sentencepiece", path=str(tmp_path / "sp")).build() \
        .fingerprint() == tok.fingerprint()  # the folder's tokenizer.model
    (tmp_path / "bad.model").write_bytes(b"not a model")
    with pytest.raises(RecipeError, match="not a SentencePiece model"):
        default_config("tokenizer", "sentencepiece", path=str(tmp_path / "bad.model")).build()


def test_tiktoken_matches_the_bpe_it_was_made_from(tmp_path):
    pytest.importorskip("tiktoken")
    ranks = tiktoken_ranks(tmp_path / "tt")
    tok = default_config("tokenizer", "tiktoken", path=str(ranks), pattern="gpt2",
                         special_tokens=["<|bos|>", "<|eos|>"], bos_token="<|bos|>",
                         eos_token="<|eos|>", num_special=3).build()
    hf = default_config("tokenizer", "huggingface",
                        path=str(trained_tokenizer(tmp_path / "hf"))).build()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (400, 397, 398, None)
    for text in [TEXT, *stdlib_texts()[:3]]:
        assert [i + 3 for i in tok.encode(text, bos=False)] == hf.encode(text, bos=False)
        assert tok.decode(tok.encode(text)) == text
    batch = tok.encode_batch([TEXT, "x"])
    assert batch[0].tolist() == tok.encode(TEXT, bos=False)
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode(TEXT) == tok.encode(TEXT) and clone.fingerprint() == tok.fingerprint()
    other = default_config("tokenizer", "tiktoken", path=str(ranks), pattern="llama3",
                           special_tokens=["<|bos|>", "<|eos|>"], bos_token="<|bos|>",
                           eos_token="<|eos|>").build()
    assert other.fingerprint() != tok.fingerprint()  # another pattern is another mapping


def test_tiktoken_bad_input(tmp_path):
    pytest.importorskip("tiktoken")
    ranks = tiktoken_ranks(tmp_path / "tt")
    with pytest.raises(RecipeError, match="tokenizer.bos_token = '<s>' is not among"):
        default_config("tokenizer", "tiktoken", path=str(ranks), bos_token="<s>").build()
    (tmp_path / "bad.tiktoken").write_text("QUJD 0\nnot-a-line\n")
    with pytest.raises(RecipeError, match=r"bad.tiktoken:2: not a tiktoken ranks line"):
        default_config("tokenizer", "tiktoken", path=str(tmp_path / "bad.tiktoken")).build()

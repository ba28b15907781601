from __future__ import annotations

from kiln.components.base import default_config
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer


def test_round_trip_ascii_and_unicode():
    tok = ByteTokenizer()
    for text in ["", "def f(x):\n    return x\n", "naïve café — 日本語 🙂"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and all(0 <= i < 256 for i in ids[1:])
        assert tok.decode(ids) == text


def test_specials_and_vocab():
    tok = ByteTokenizer()
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (256, 257, 258)
    assert tok.encode("a", bos=False, eos=True) == [97, tok.eos_id]
    assert tok.decode([tok.bos_id, 104, 105, tok.eos_id]) == "hi"
    assert tok.encode_array("hé").tolist() == list("hé".encode())


def test_invalid_utf8_is_replaced():
    assert ByteTokenizer().decode([0xFF, 104]) == "\ufffdh"


def test_built_from_registry_and_fingerprint_is_stable():
    tok = default_config("tokenizer", "byte", add_bos=False).build()
    assert tok.encode("ab") == [97, 98]
    assert tok.fingerprint() == ByteTokenizer().fingerprint()  # add_bos does not change ids

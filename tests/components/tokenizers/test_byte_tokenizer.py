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


TEXTS = ["", "def f(x):\n    return x\n", "naïve café — 日本語 🙂\t\x00\x7f", "<0x41> <s> </s>",
         "\r\n  two  spaces\u00a0and a zero-width\u200bjoiner"]


def test_exported_files_give_kiln_s_ids_in_tokenizers_and_transformers(tmp_path):
    """An export of a byte-tokenizer model ships a tokenizer.json: byte b -> id b, BOS 256,
    EOS 257, no ByteLevel remapping, for the tokenizers library and transformers alike."""
    import transformers  # a dev dependency (pyproject.toml): this test never skips
    from tokenizers import Tokenizer

    tok = ByteTokenizer()
    assert tok.save_files(tmp_path) == ["tokenizer.json", "tokenizer_config.json"]
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert raw.get_vocab_size() == len(hf) == tok.vocab_size == 258
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (256, 257, None)
    for text in TEXTS:
        assert raw.encode(text).ids == hf(text)["input_ids"] == tok.encode(text)
        bare = tok.encode(text, bos=False)
        assert raw.encode(text, add_special_tokens=False).ids == bare
        assert hf(text, add_special_tokens=False)["input_ids"] == bare
        ids = tok.encode(text, eos=True)
        assert raw.decode(ids) == hf.decode(ids, skip_special_tokens=True) == tok.decode(ids)
        assert tok.decode(ids) == text
    # kiln's ids for the specials' own texts too: transformers splits them (split_special_tokens)
    for text in ("<|bos|>", "x<|eos|>"):
        assert hf(text)["input_ids"] == tok.encode(text)
    assert hf.decode([256]) == "<|bos|>"  # the harness's hf model looks for a BOS prefix by it

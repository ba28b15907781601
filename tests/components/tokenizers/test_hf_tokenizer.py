"""The huggingface tokenizer: local files and folders, special tokens, the Hub through a
pre-filled offline cache, and the errors for bad paths."""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest

from kiln.components.base import default_config
from kiln.components.errors import RecipeError
from tests.components.tokenizers.tokenizer_files import gpt2_style, stdlib_texts, trained_tokenizer

COMMIT = "a" * 40


def _build(path, **values):
    return default_config("tokenizer", "huggingface", path=str(path), **values).build()


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return trained_tokenizer(tmp_path_factory.mktemp("tok") / "bpe")


def test_file_and_folder_load_the_same_tokenizer(tok_dir):
    a, b = _build(tok_dir), _build(tok_dir / "tokenizer.json")
    assert a.fingerprint() == b.fingerprint() and a.vocab_size == 400
    assert (a.bos_id, a.eos_id, a.pad_id) == (0, 1, 2)  # from tokenizer_config.json
    text = "def f(x):\n    return x  # naïve — 日本語\n"
    ids = a.encode(text)
    assert ids[0] == a.bos_id and a.decode(ids) == text
    assert a.encode(text, bos=False, eos=True)[-1] == a.eos_id
    assert a.encode_array(text).tolist() == ids[1:]
    batch = a.encode_batch(list(stdlib_texts()[:3]))
    assert [x.tolist() for x in batch] == [a.encode(t, bos=False) for t in stdlib_texts()[:3]]
    assert a.decode([a.bos_id, *ids[1:3]], skip_special=False).startswith("<|bos|>")


def test_overrides_and_pickling(tok_dir):
    tok = _build(tok_dir, bos_token="<|eos|>", pad_token="<|bos|>")
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (1, 1, 0)
    assert tok.fingerprint() != _build(tok_dir).fingerprint()  # other specials, other ids
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("abc") == tok.encode("abc") and clone.fingerprint() == tok.fingerprint()


def test_gpt2_style_uses_its_one_separator_for_both(tmp_path):
    tok = _build(gpt2_style(tmp_path / "g"))
    assert tok.bos_id == tok.eos_id and tok.pad_id is None


def test_tokenizer_without_specials_is_an_error(tmp_path):
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[])).save(str(tmp_path / "t.json"))
    with pytest.raises(RecipeError, match="set tokenizer.bos_token"):
        _build(tmp_path / "t.json")


@pytest.mark.parametrize("values, match", [
    ({"path": ""}, "tokenizer.path is empty"),
    ({"path": "/nowhere/tokenizer.json"}, "does not exist"),
    ({"path": "hf://just-a-name"}, "hf://owner/repo"),
])
def test_bad_paths(values, match):
    with pytest.raises(RecipeError, match=match):
        default_config("tokenizer", "huggingface", **values).build()


def test_override_that_is_not_a_token(tok_dir):
    with pytest.raises(RecipeError, match="tokenizer.bos_token = '<s>' is not a token"):
        _build(tok_dir, bos_token="<s>")


def test_corrupt_file(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(RecipeError, match="not a tokenizer.json"):
        _build(tmp_path)


def fill_cache(cache, repo_id: str, src, kind: str = "models", ref: str = "main"):
    """Lay ``src``'s files out as the Hub cache holds a downloaded snapshot of ``repo_id``."""
    repo = cache / f"{kind}--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / ref).write_text(COMMIT)
    snap = repo / "snapshots" / COMMIT
    shutil.copytree(src, snap, dirs_exist_ok=True)
    return snap


def test_hub_path_reads_the_offline_cache(offline_cache, tok_dir):
    fill_cache(offline_cache, "me/tok", tok_dir)
    tok = _build("hf://me/tok")
    assert tok.fingerprint() == _build(tok_dir).fingerprint() and tok.bos_id == 0
    assert _build(f"hf://me/tok@{COMMIT}").vocab_size == 400
    with pytest.raises(RecipeError, match="not in the local Hub cache and HF_HUB_OFFLINE"):
        _build("hf://me/other")


def test_ids_fit_the_vocabulary(tok_dir):
    tok = _build(tok_dir)
    ids = np.concatenate(tok.encode_batch(list(stdlib_texts())))
    assert ids.max() < tok.vocab_size and ids.min() >= 3  # specials never come from text


@pytest.mark.parametrize("source", ["bpe", "gpt2_style"])
def test_save_files_is_what_transformers_loads(tok_dir, tmp_path, source):
    """The export's tokenizer: the same ids in transformers, with kiln's specials (recipe
    overrides included; a source without tokenizer_config.json gets one)."""
    import transformers  # a dev dependency (pyproject.toml): this test never skips

    path = tok_dir if source == "bpe" else gpt2_style(tmp_path / "src")
    tok = _build(path, eos_token="<|pad|>") if source == "bpe" else _build(path)
    out = tmp_path / "export"
    out.mkdir()
    assert tok.save_files(out) == ["tokenizer.json", "tokenizer_config.json"]
    hf = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x  # naïve — 日本語\n"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text, bos=False)
    assert (hf.bos_token_id, hf.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert hf.pad_token_id == tok.pad_id
    assert _build(out).fingerprint() == tok.fingerprint()  # kiln reads its export back alike

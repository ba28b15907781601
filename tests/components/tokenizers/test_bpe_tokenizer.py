"""The bpe tokenizer: trained on first use, cached and reused; the same tokenizer as the
huggingface one reading its cache folder; deterministic."""

from __future__ import annotations

from kiln.components.base import default_config
from kiln.components.tokenizers.bpe_train import build_bpe
from tests.components.data.corpora import DOCS, write_jsonl
from tests.components.tokenizers.tokenizer_files import stdlib_texts


def test_trained_once_then_reused(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [*stdlib_texts()[:5], *DOCS])
    cfg = default_config("tokenizer", "bpe", inputs=[str(src)], vocab_size=300, max_bytes=0,
                         cache_dir=str(tmp_path / "cache"))
    tok = cfg.build()
    assert tok.vocab_size == 300 and (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    file = tok.file
    stamp = file.stat().st_mtime_ns
    again = cfg.build()
    assert again.file == file and file.stat().st_mtime_ns == stamp  # not trained again
    hf = default_config("tokenizer", "huggingface", path=str(file.parent)).build()
    assert hf.fingerprint() == tok.fingerprint() and hf.encode(DOCS[3]) == tok.encode(DOCS[3])
    out = tmp_path / "export"  # what `kiln export` writes beside the weights
    out.mkdir()
    assert tok.save_files(out) == ["tokenizer.json", "tokenizer_config.json"]
    exported = default_config("tokenizer", "huggingface", path=str(out)).build()
    assert exported.fingerprint() == tok.fingerprint()
    other = default_config("tokenizer", "bpe", inputs=[str(src)], vocab_size=320, max_bytes=0,
                           cache_dir=str(tmp_path / "cache")).build()
    assert other.file.parent != file.parent and other.vocab_size == 320


def test_training_is_deterministic():
    texts = list(stdlib_texts()[:8])
    assert build_bpe(texts, 350).to_str() == build_bpe(texts, 350).to_str()

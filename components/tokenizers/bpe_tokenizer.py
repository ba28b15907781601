"""The ``bpe`` tokenizer: a byte-level BPE that kiln trains on local text on first use and
caches, so a recipe gets a real subword tokenizer with no download and no extra command.

The cache entry (``$KILN_CACHE/tokenizers/bpe-<key>/``) is keyed by the inputs (names and
sizes), the settings and the ``tokenizers`` version; it holds the same ``tokenizer.json`` +
``tokenizer_config.json`` that ``kiln tokenizer train`` writes, so ``[tokenizer] type =
"huggingface"`` with ``path`` set to that folder is the same tokenizer (same fingerprint).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import Field

from kiln.components.base import ComponentConfig
from kiln.components.caching import cache_root, file_lock
from kiln.components.registry import register
from kiln.components.sources.text_sources import expand_inputs
from kiln.components.tokenizers.bpe_train import MIN_VOCAB, Documents, build_bpe, save_bpe
from kiln.components.tokenizers.hf_tokenizer import TOKENIZER_FILE, TokenizerFile


class BpeTokenizerConfig(ComponentConfig):
    """A byte-level BPE trained (once, then cached) on local text."""

    vocab_size: int = Field(4096, ge=MIN_VOCAB, description="entries, specials included")
    inputs: list[str] = Field(
        default_factory=lambda: ["stdlib"], min_length=1,
        description='text to train on: files, folders, globs or "stdlib" (as kiln data prepare)')
    text_field: str = Field("text", description="JSONL field / column holding the text")
    max_bytes: int = Field(8_000_000, ge=0, description="train on at most this much text "
                           "(whole documents, in input order; 0 = all)")
    min_frequency: int = Field(2, ge=1, description="pairs seen fewer times are not merged")
    add_bos: bool = Field(True, description="encode() starts a text with BOS")
    add_eos: bool = Field(False, description="encode() ends a text with EOS")
    cache_dir: str = Field("", description='cache root; "" = $KILN_CACHE or ~/.cache/kiln')


def trained_folder(cfg: BpeTokenizerConfig) -> Path:
    """The cache folder for ``cfg``, trained into place if it is not there yet."""
    import tokenizers


    files = expand_inputs(cfg.inputs)
    parts = [[(f.name, f.size) for f in files], cfg.vocab_size, cfg.text_field, cfg.max_bytes,
             cfg.min_frequency, tokenizers.__version__]
    key = hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]
    folder = cache_root(cfg.cache_dir) / "tokenizers" / f"bpe-{key}"
    if not (folder / TOKENIZER_FILE).is_file():
        with file_lock(folder.parent / f".{folder.name}.lock"):
            if not (folder / TOKENIZER_FILE).is_file():
                texts = Documents(files, text_field=cfg.text_field, max_bytes=cfg.max_bytes)
                save_bpe(build_bpe(texts, cfg.vocab_size, min_frequency=cfg.min_frequency),
                         folder)
    return folder


@register("tokenizer", "bpe")
class BpeTokenizer(TokenizerFile):
    """Byte-level BPE that kiln trains on local text (default: the stdlib) and caches."""

    Config = BpeTokenizerConfig

    def __init__(self, cfg: BpeTokenizerConfig, **context: object) -> None:
        self.cfg = cfg
        folder = trained_folder(cfg)
        super().__init__(folder / TOKENIZER_FILE, source=str(folder), overrides={},
                         add_bos=cfg.add_bos, add_eos=cfg.add_eos)

"""Training a byte-level BPE tokenizer with the ``tokenizers`` library, offline and deterministic.

The result is a folder with ``tokenizer.json`` (GPT-2-style byte-level BPE: every byte string
encodes, nothing is unknown) and ``tokenizer_config.json`` naming BOS / EOS / pad, so the
``huggingface`` tokenizer (and ``transformers``) load it as it is. The folder is written aside
and renamed into place: a crash never leaves a half-written tokenizer at ``out``.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from kiln.components.errors import DataError

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIALS = (BOS, EOS, PAD)  # ids 0, 1, 2
MIN_VOCAB = 256 + len(SPECIALS)  # every byte plus the specials


class Documents:
    """The documents of some input files, in order, capped at ``max_bytes`` of UTF-8 text
    (whole documents; 0 = no cap); counts what it yielded."""

    def __init__(self, files: list[Any], *, text_field: str = "text", max_bytes: int = 0) -> None:
        self.files, self.text_field, self.max_bytes = files, text_field, max_bytes
        self.docs = self.bytes = 0

    def __iter__(self) -> Iterator[str]:
        from kiln.components.sources.text_sources import read_documents

        self.docs = self.bytes = 0
        for src in self.files:
            for _, _, text in read_documents(src, text_field=self.text_field):
                n = len(text.encode("utf-8"))
                if self.max_bytes and self.bytes + n > self.max_bytes:
                    continue
                self.docs, self.bytes = self.docs + 1, self.bytes + n
                yield text


def build_bpe(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> object:
    """A ``tokenizers.Tokenizer`` trained on ``texts`` (the same texts give the same merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size < MIN_VOCAB:
        raise DataError(f"vocab size {vocab_size} is too small for a byte-level BPE: it needs "
                        f"at least {MIN_VOCAB} (256 bytes + {len(SPECIALS)} specials)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_bpe(tok: object, out: str | Path) -> Path:
    """Write ``tokenizer.json`` + ``tokenizer_config.json`` into a new folder ``out``."""
    out = Path(out).expanduser()
    if (out / "tokenizer.json").exists():
        raise DataError(f"{out / 'tokenizer.json'} already exists; choose another --out or "
                        "delete it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        tok.save(str(tmp / "tokenizer.json"))  # type: ignore[attr-defined]
        config = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
                  "model_max_length": 1 << 30, "tokenizer_class": "PreTrainedTokenizerFast",
                  "clean_up_tokenization_spaces": False}
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # an empty folder made by the user: take its place
        try:
            os.rename(tmp, out)
        except OSError:
            if not (out / "tokenizer.json").is_file():
                raise DataError(f"cannot create {out}: it exists and is not empty; choose "
                                "another --out") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

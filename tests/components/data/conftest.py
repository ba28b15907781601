"""Tiny synthetic corpora and dataset folders for the data tests."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from kiln.components.data.packed_documents import PackedDocuments, PackedDocumentsConfig
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer
from tests.checkpointing.huggingface.test_hub import offline_cache  # noqa: F401 - the Hub cache fixture


def write_corpus(folder: Path, num_docs: int = 40, seed: int = 0) -> Path:
    """``num_docs`` .txt files of random lowercase text, 5-120 characters each."""
    rnd = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(num_docs):
        text = "".join(rnd.choice("abcdefghij klmnop\n") for _ in range(rnd.randint(5, 120)))
        (folder / f"doc{i:03d}.txt").write_text(text)
    return folder


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture
def make_dataset(tmp_path, corpus):
    """make_dataset(seq_len=8, seed=0, **config) -> a prepared PackedDocuments on ``corpus``."""

    def _make(seq_len: int = 8, seed: int = 0, **values) -> PackedDocuments:
        values = {"source": "folder", "source_path": str(corpus),
                  "cache_dir": str(tmp_path / "cache"), "eval_fraction": 0.1, **values}
        cfg = PackedDocumentsConfig(type="packed_documents", **values)
        ds = cfg.build(tokenizer=ByteTokenizer(), seq_len=seq_len, seed=seed)
        ds.prepare()
        return ds

    return _make


def epoch_stream(ds: PackedDocuments, split: str, epoch: int) -> np.ndarray:
    """The split's token stream for a data epoch, rebuilt independently of the loader."""
    start, length = ds.layout.order(split, epoch)
    tokens = np.asarray(ds.layout.tokens)
    return np.concatenate([tokens[s:s + n] for s, n in zip(start, length, strict=True)])

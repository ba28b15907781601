"""Small tokenizer.json files trained in the test run on this machine's stdlib text (offline)."""

from __future__ import annotations

import functools
import json
import sysconfig
from pathlib import Path

from kiln.components.data.bpe_train import build_bpe, save_bpe


@functools.cache
def stdlib_texts(num_files: int = 30) -> tuple[str, ...]:
    """The first ``num_files`` top-level stdlib modules, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))[:num_files]
    return tuple(f.read_text(encoding="utf-8", errors="replace") for f in files)


@functools.cache
def _trained_json(vocab_size: int) -> str:
    return build_bpe(stdlib_texts(), vocab_size).to_str()


def trained_tokenizer(folder: Path, vocab_size: int = 400) -> Path:
    """A folder with tokenizer.json + tokenizer_config.json (BOS <|bos|>, EOS <|eos|>)."""
    from tokenizers import Tokenizer

    return save_bpe(Tokenizer.from_str(_trained_json(vocab_size)), folder)


def gpt2_style(folder: Path) -> Path:
    """A tokenizer.json whose only special token is <|endoftext|> and no config beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    data = json.loads(_trained_json(400))
    for entry in data["added_tokens"]:
        entry["content"] = {"<|bos|>": "<|endoftext|>", "<|eos|>": "<|x|>",
                            "<|pad|>": "<|y|>"}[entry["content"]]
    vocab = data["model"]["vocab"]
    for old, new in (("<|bos|>", "<|endoftext|>"), ("<|eos|>", "<|x|>"), ("<|pad|>", "<|y|>")):
        vocab[new] = vocab.pop(old)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder / "tokenizer.json"

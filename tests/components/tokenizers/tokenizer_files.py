"""Small tokenizer.json files trained in the test run on this machine's stdlib text (offline)."""

from __future__ import annotations

import functools
import json
import sysconfig
from pathlib import Path

from kiln.components.tokenizers.bpe_train import build_bpe, save_bpe


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


def sentencepiece_model(folder: Path, vocab_size: int = 700) -> Path:
    """A SentencePiece BPE .model trained here on stdlib text (BOS 1, EOS 2, pad 3)."""
    import io

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(line for t in stdlib_texts() for line in t.splitlines() if line),
        model_writer=model, vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
        pad_id=3, minloglevel=2, num_threads=1, split_digits=True, character_coverage=0.99,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.model").write_bytes(model.getvalue())
    return folder / "tokenizer.model"


def tiktoken_ranks(folder: Path, vocab_size: int = 400) -> Path:
    """A .tiktoken ranks file made from the byte-level BPE trained here: the same merges, so
    the same ids (less the 3 specials) with the gpt2 pattern."""
    import base64

    data = json.loads(_trained_json(vocab_size))
    byte_of = {ch: b for b, ch in enumerate(_bytes_to_unicode())}
    lines = []
    for token, idx in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]):
        if idx < 3:
            continue
        raw = bytes(byte_of[c] for c in token)
        lines.append(f"{base64.b64encode(raw).decode()} {idx - 3}")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "ranks.tiktoken").write_text("\n".join(lines) + "\n")
    return folder / "ranks.tiktoken"


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in character for each byte value 0..255, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars

"""A small Hugging Face tokenizer folder with the chat templates' special tokens, built here
(nothing downloaded): a byte-level BPE trained on a few sentences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

TEMPLATES = Path(__file__).parent / "templates"
SPECIALS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>",
            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 plus 3?"},
     {"role": "assistant", "content": "2 + 3 = 5."}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Name a prime."},
     {"role": "assistant", "content": "Seven."},
     {"role": "user", "content": "And an even one?"},
     {"role": "assistant", "content": "Two, the only one."}],
    [{"role": "user", "content": "Héllo wörld ✓"},
     {"role": "assistant", "content": " spaced  answer \n"},
     {"role": "user", "content": "again"},
     {"role": "assistant", "content": "done"}],
]


def make_folder(folder: Path, template: str) -> Path:
    """tokenizer.json + tokenizer_config.json (bos <s>, eos </s>, the template) in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["assistant user system"]
    tok.train_from_iterator(text, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory) -> dict[str, Path]:
    """name -> a tokenizer folder whose template is ``templates/NAME.jinja``."""
    root = tmp_path_factory.mktemp("chat_tokenizers")
    return {p.stem: make_folder(root / p.stem, p.read_text()) for p in TEMPLATES.glob("*.jinja")}

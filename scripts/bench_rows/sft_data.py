"""SFT data preparation: kiln's chat rendering, assistant mask and tokenization
(``components/data/chat/masks.encode``) against ``transformers``' ``apply_chat_template(...,
tokenize=True, return_assistant_tokens_mask=True)``, conversations per second. Both read the
same tokenizer folder (a byte-level BPE of 2,000 tokens trained in ``setup`` on the built-in
arithmetic dialogues, with a ChatML template that marks ``{% generation %}``) and prepare the
same 2,000 conversations (1 to 3 turns); both sides check their ids against each other's in
the tests (``tests/components/data/chat/test_masks.py``), not here.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench_rows.common import Unavailable, median_seconds, set_threads

TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + "
    "'<|im_end|>' }}{% endgeneration %}{{ '\\n' }}{% else %}{{ message['content'] + "
    "'<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def _conversations(n: int) -> list[list[dict]]:
    from kiln.components.data.chat.builtin import conversations

    return [row["messages"] for row in conversations(n, seed=0)]


def setup(work: Path) -> None:
    if (work / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [m["content"] for c in _conversations(2000) for m in c]
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    work.mkdir(parents=True, exist_ok=True)
    tok.save(str(work / "tokenizer.json"))
    (work / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast"}))


def kiln(p: dict) -> dict:
    from kiln.components.data.chat import masks
    from kiln.components.tokenizers import chat_templates as templates
    from kiln.components.tokenizers.hf_tokenizer import (
        HuggingFaceTokenizer,
        HuggingFaceTokenizerConfig,
    )

    set_threads(p["threads"])
    tok = HuggingFaceTokenizer(HuggingFaceTokenizerConfig(type="huggingface", path=p["work"]))
    template = templates.resolve("", tok)
    convs = _conversations(p["conversations"])

    def run() -> int:
        return sum(int(masks.encode(template, tok, c, "assistant", "bench", bos=False)[1].sum())
                   for c in convs)

    trained = run()  # warm-up (template compiled, caches)
    seconds = median_seconds(run, p["repeats"])
    return {"conversations_per_second": len(convs) / seconds, "trained_tokens": trained}


def peer(p: dict) -> dict:
    try:
        import transformers
    except ImportError as exc:
        raise Unavailable(f"transformers is not importable in {sys.executable} ({exc})") from None
    set_threads(p["threads"])
    tok = transformers.AutoTokenizer.from_pretrained(p["work"])
    convs = _conversations(p["conversations"])

    def run() -> int:
        return sum(sum(tok.apply_chat_template(c, tokenize=True, return_dict=True,
                                               return_assistant_tokens_mask=True)
                       ["assistant_masks"]) for c in convs)

    trained = run()
    seconds = median_seconds(run, p["repeats"])
    return {"conversations_per_second": len(convs) / seconds, "trained_tokens": trained,
            "version": f"transformers {transformers.__version__}"}

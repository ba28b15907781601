"""Every tokenizer x every way of feeding data: each registered tokenizer through ``prepare``,
and two of them through the other datasets, train the dense family 2 steps (finite), with the
model's vocabulary padded, never smaller than the tokenizer's."""

from __future__ import annotations

import math

import pytest

from kiln.components import registry
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS
from tests.recipes.test_combinations import FAMILIES, STEPS, TINY, train


def _tokenizer_overrides(name: str, folder) -> tuple[str, ...]:
    """A small instance of each registered tokenizer (files made in the test, offline)."""
    from tests.components.tokenizers import tokenizer_files as files

    if name == "byte":
        return ("--tokenizer.type=byte",)
    if name == "bpe":
        return ("--tokenizer.type=bpe", "--tokenizer.vocab_size=300",
                "--tokenizer.max_bytes=200000", f"--tokenizer.cache_dir={folder}")
    pytest.importorskip({"sentencepiece": "sentencepiece", "tiktoken": "tiktoken"}.get(
        name, "tokenizers"))
    make = {"sentencepiece": files.sentencepiece_model, "tiktoken": files.tiktoken_ranks}.get(
        name, files.trained_tokenizer)
    extra = ("--tokenizer.special_tokens=[\"<s>\", \"</s>\"]", "--tokenizer.bos_token=\"<s>\"",
             "--tokenizer.eos_token=\"</s>\"") if name == "tiktoken" else ()
    return (f"--tokenizer.type={name}", f"--tokenizer.path={make(folder / name)}", *extra)


def _data_overrides(kind: str, tokenizer, folder) -> tuple[str, ...]:
    from kiln.components.data.prepare.prepare import PrepareOptions, prepare
    from tests.components.data.corpora import write_jsonl
    from tests.components.tokenizers.tokenizer_files import stdlib_texts

    corpus = write_jsonl(folder / "corpus.jsonl", list(stdlib_texts()[:12]))
    if kind == "streaming_text":
        return ("--data.type=streaming_text", f"--data.inputs=[\"{corpus}\"]",
                "--data.eval_docs=2")
    out = folder / "prepared"
    if kind == "balanced_shards":
        for domain in ("a", "b"):
            prepare(PrepareOptions([str(corpus)], str(out), domain=domain, shard_tokens=4000),
                    tokenizer, progress=False)
        return ("--data.type=balanced_shards", f"--data.path={out}",
                "--data.domains=[\"a\", \"b\"]", "--data.eval_rows=2")
    prepare(PrepareOptions([str(corpus)], str(out), seq_len=32, eval_fraction=0.2), tokenizer,
            progress=False)
    return ("--data.type=packed_documents", f"--data.path={out}")


# Every tokenizer through `prepare`; past preparing, datasets see ids only: two tokenizers (one
# with a file, one without) cover each other way of feeding data.
DATA_CASES = [(t, "prepared") for t in sorted(registry.names("tokenizer"))] + [
    (t, d) for t in ("byte", "huggingface") for d in ("streaming_text", "balanced_shards")]


@pytest.mark.parametrize("tokenizer, data", DATA_CASES)
def test_every_tokenizer_with_every_dataset(tmp_path, tokenizer, data):
    file, overrides = FAMILIES["dense"]
    tok_args = _tokenizer_overrides(tokenizer, tmp_path)
    probe = load_recipe(CONFIGS / file, [*TINY, *overrides, *tok_args]).tokenizer.build()
    keep = tuple(o for o in TINY if not o.startswith("--data."))
    recipe = load_recipe(CONFIGS / file, [*keep, *overrides, *tok_args,
                                          *_data_overrides(data, probe, tmp_path),
                                          f"--run.folder={tmp_path / 'run'}"])
    losses, trainer = train(recipe)
    assert len(losses) == STEPS and all(map(math.isfinite, losses)), losses
    vocab, model_vocab = trainer.tokenizer.vocab_size, trainer.model.vocab_size
    assert model_vocab % 64 == 0 and vocab <= model_vocab < vocab + 64  # padded, never smaller

"""Exact match: answers pulled out by regex, the harness's normalisation, stop strings; greedy
generation with the KV cache equals generation without it."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.components.errors import DataError
from kiln.components.tasks import runner
from kiln.components.tasks.bits_per_byte import windows
from tests.components.tasks import samples


class Echo:
    """A scorer whose 'generation' is given text (encoded), per example in plan order."""

    def __init__(self, texts, tokenizer):
        self.texts, self.tok = texts, tokenizer
        self.calls = []

    def generate(self, prompts, *, max_new_tokens, stop, decode, eos_id):
        self.calls.append((len(prompts), max_new_tokens, stop))
        return [self.tok.encode(self.texts.pop(0), bos=False) for _ in prompts]


def test_gsm8k_style_extraction_and_normalisation(tmp_path):
    rows = [{"question": "a?", "answer": "work\n#### 1,000"},
            {"question": "b?", "answer": "#### 7"},
            {"question": "c?", "answer": "#### 3"}]
    tok = samples.byte_tokenizer()
    task = samples.task("exact_match", samples.write_jsonl(tmp_path / "g.jsonl", rows),
                        preset="gsm8k", batch_size=1)
    plan = task.plan(tok, 512)
    outputs = {0: "so #### 1000.\nQuestion: next", 1: "#### 8", 2: "no number"}
    echo = Echo([outputs[b.units[0]] for b in plan.batches], tok)
    # three examples scored 1, 0, 0: the mean and its sample standard error
    assert runner.run(task, plan, echo) == {"exact_match": pytest.approx(1 / 3),
                                            "exact_match_stderr": pytest.approx(1 / 3)}
    assert echo.calls[0] == (1, 256, ["Question:", "</s>", "<|im_end|>"])
    assert task.extract("x #### 5 y #### 6") == "5" and task.extract("none") == "[invalid]"
    assert task.normalize("$1,000.") == "1000"


def test_last_match_case_punctuation(tmp_path):
    rows = [{"prompt": "p", "answer": "Paris!"}]
    task = samples.task("exact_match", samples.write_jsonl(tmp_path / "t.jsonl", rows),
                        extract_regex=r"answer is (\w+)", extract="last", ignore_case=True,
                        ignore_punctuation=True)
    assert task.extract("answer is Rome. no, the answer is PARIS") == "PARIS"
    assert task.normalize("PARIS") == task.normalize("Paris!")


def test_gold_must_match_the_answer_regex(tmp_path):
    path = samples.write_jsonl(tmp_path / "t.jsonl", [{"prompt": "p", "answer": "42"}])
    with pytest.raises(DataError, match=r"task 'g': .*t.jsonl: example 0 \(the file's 1st\): "
                                        "the answer '42' does not match answer_regex"):
        samples.task("exact_match", path, name="g", answer_regex="#### (.*)").plan(
            samples.byte_tokenizer(), 256)
    with pytest.raises(DataError, match="max_new_tokens = 64 leaves no room"):
        samples.task("exact_match", path, max_new_tokens=64).plan(samples.byte_tokenizer(), 64)


@pytest.mark.parametrize("use_cache", [True, False])
def test_generation_stops_at_the_stop_string(tmp_path, use_cache):
    data = samples.rows(5)
    rows = [{"prompt": r["prompt"], "answer": "x"} for r in data]
    tok = samples.byte_tokenizer()
    task = samples.task("exact_match", samples.write_jsonl(tmp_path / "t.jsonl", rows),
                        max_new_tokens=12, stop=["a", "e"], batch_size=5)
    plan = task.plan(tok, 128)
    (batch,) = plan.batches
    model = samples.tiny_model()
    texts = task.generations(samples.scorer(model, use_cache=use_cache), batch)
    assert all("a" not in t and "e" not in t for t in texts)
    # the reference: each prompt alone, greedy, without stop strings, cut at the first stop
    from kiln.components.models.generation import Sampling, generate

    for ex, text in zip(batch.payload, texts, strict=True):
        ids = generate(model, [ex.prompt], max_new_tokens=12, sampling=Sampling(temperature=0),
                       vocab_size=258, eos_id=tok.eos_id, use_cache=False)[0]
        full = tok.decode(ids)
        assert text == full.split("a")[0].split("e")[0]


def test_bits_per_byte_windows_score_every_token_once():
    tokens = list(range(10))
    got = windows(tokens, 99, 4)
    assert [n for _, n in got] == [4, 4, 2]
    assert got[0][0] == [99, 0, 1, 2, 3] and got[2][0] == [5, 6, 7, 8, 9]
    scored = [t for ids, n in got for t in ids[-n:]]
    assert scored == tokens and all(len(ids) - 1 <= 4 for ids, _ in got)


def test_bits_per_byte_equals_the_loss_of_one_forward(tmp_path):
    texts = ["kiln fires clay", "ünïcode text, longer than the window " * 2]
    path = samples.write_jsonl(tmp_path / "t.jsonl", [{"page": t} for t in texts])
    tok, model = samples.byte_tokenizer(), samples.tiny_model(max_seq_len=128)
    task = samples.task("bits_per_byte", path, preset="wikitext", batch_size=2)
    got = runner.run(task, task.plan(tok, 128), samples.scorer(model))["bits_per_byte"]
    nll = 0.0
    for t in texts:  # each short enough for one window: one forward from BOS
        ids = torch.tensor([[256, *t.encode("utf-8")]])
        with torch.no_grad():
            logp = model(ids[:, :-1]).float().log_softmax(-1)  # the whole vocabulary
        nll -= float(logp.gather(-1, ids[:, 1:, None]).sum())
    assert got == pytest.approx(nll / math.log(2) / sum(len(t.encode()) for t in texts),
                                rel=1e-5)
    small = runner.run(task, task.plan(tok, 16), samples.scorer(model))["bits_per_byte"]
    assert math.isfinite(small) and small != got  # windows of 16: less context, other value
    txt = tmp_path / "doc.txt"
    txt.write_text(texts[0])
    one = samples.task("bits_per_byte", txt)
    assert one.plan(tok, 128).examples == 1


def test_a_chat_template_renders_shots_as_turns_and_stops_at_the_end_of_turn(tmp_path):
    from kiln.components.tokenizers import chat_templates as templates

    rows = [{"prompt": "2+2?", "answer": "4"}, {"prompt": "3+3?", "answer": "6"}]
    tok = samples.byte_tokenizer()
    task = samples.task("exact_match", samples.write_jsonl(tmp_path / "c.jsonl", rows),
                        chat_template="chatml", num_fewshot=1, batch_size=1)
    plan = task.plan(tok, 256)
    first = next(e for b in plan.batches for e in b.payload if e.gold == "4")
    want = templates.prompt_ids(templates.resolve("chatml", tok), tok, [
        {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "6"},
        {"role": "user", "content": "2+2?"}])
    assert first.prompt == want
    assert tok.decode(want).endswith("<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    echo = Echo(["4<|im_end|>\n<|im_start|>user", "5"], tok)
    assert runner.run(task, plan, echo) == {"exact_match": pytest.approx(1 / 2),
                                            "exact_match_stderr": pytest.approx(1 / 2)}
    assert echo.calls[0][2] == ["\n\n", "<|im_end|>"]

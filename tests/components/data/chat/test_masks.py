"""Rendered text, token ids and assistant masks equal transformers' apply_chat_template."""

from __future__ import annotations

import pytest

from kiln.components.data.chat import masks
from kiln.components.errors import DataError
from kiln.components.tokenizers import chat_templates as templates
from kiln.components.tokenizers.byte_tokenizer import ByteTokenizer
from kiln.components.tokenizers.hf_tokenizer import HuggingFaceTokenizer, HuggingFaceTokenizerConfig
from tests.components.data.chat.conftest import CONVERSATIONS

transformers = pytest.importorskip("transformers")


def _pair(folder):
    ours = HuggingFaceTokenizer(HuggingFaceTokenizerConfig(type="huggingface", path=str(folder)))
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    return ours, theirs


def _conversations(name):  # Mistral's template takes no system message (tested below)
    return [c for c in CONVERSATIONS if name != "mistral" or c[0]["role"] != "system"]


@pytest.mark.parametrize("name", ["llama3", "qwen2_5", "mistral", "chatml_generation"])
def test_render_and_ids_equal_transformers(hf_folders, name):
    ours, theirs = _pair(hf_folders[name])
    template = templates.resolve("", ours)
    for conv in _conversations(name):
        for gen in (False, True):
            text, _ = template.render(conv, add_generation_prompt=gen)
            assert text == theirs.apply_chat_template(conv, tokenize=False,
                                                      add_generation_prompt=gen)
        ids, mask = masks.encode(template, ours, conv, "assistant", "row", bos=False)
        want = theirs.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        assert ids.tolist() == list(want)
        assert mask.any() and not mask[0]


@pytest.mark.parametrize("name", ["chatml_generation", "two_generation"])
def test_generation_masks_equal_return_assistant_tokens_mask(hf_folders, name):
    """One {% generation %} block per assistant turn, or two (content, then the end of turn):
    kiln's mask is transformers' union of the marked spans."""
    ours, theirs = _pair(hf_folders[name])
    template = templates.resolve("", ours)
    for conv in CONVERSATIONS:
        got = theirs.apply_chat_template(conv, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
        ids, mask = masks.encode(template, ours, conv, "assistant", "row", bos=False)
        assert ids.tolist() == list(got["input_ids"])
        assert mask.astype(int).tolist() == list(got["assistant_masks"])


def test_two_generation_blocks_per_turn_train_the_last_turn_whole(hf_folders):
    ours, _ = _pair(hf_folders["two_generation"])
    template = templates.resolve("", ours)
    conv = CONVERSATIONS[1]
    text, spans = masks.assistant_spans(template, conv, "row")
    assert [[text[a:b] for a, b in turn] for turn in spans] == [
        ["Seven.", "</s>"], ["Two, the only one.", "</s>"]]
    ids, last = masks.encode(template, ours, conv, "last_assistant", "row", bos=False)
    assert ours.decode(ids[last], skip_special=False) == "Two, the only one.</s>"


def test_generation_blocks_that_skip_a_turn_are_refused():
    source = ("{% for m in messages %}{{ m['role'] + ': ' }}{% if m['role'] == 'assistant' "
              "and loop.last %}{% generation %}{{ m['content'] }}{% endgeneration %}"
              "{% generation %}.{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}"
              "{{ '\n' }}{% endfor %}")
    template = templates.ChatTemplate(source, "skips.jinja")
    with pytest.raises(DataError, match="cannot be assigned to the turns"):
        masks.assistant_spans(template, CONVERSATIONS[1], "row 4")


@pytest.mark.parametrize("name", ["two_generation", "llama3"])
def test_a_jinja_file_renders_with_the_tokenizers_special_tokens(hf_folders, tmp_path, name):
    """A template given as a .jinja file sees bos_token / eos_token as transformers passes
    them (it rendered them as nothing, or stopped with 'eos_token' is undefined)."""
    ours, theirs = _pair(hf_folders["chatml_generation"])
    source = (hf_folders[name] / "tokenizer_config.json").read_text()
    import json

    source = json.loads(source)["chat_template"]
    file = tmp_path / f"{name}.jinja"
    file.write_text(source)
    template = templates.resolve(str(file), ours)
    for conv in CONVERSATIONS:
        text, _ = template.render(conv)
        assert text == theirs.apply_chat_template(conv, chat_template=source, tokenize=False)
    assert name != "two_generation" or text.startswith("<s>")


def test_a_runs_saved_template_renders_with_the_tokenizers_special_tokens(hf_folders):
    """``kiln generate RUN --chat`` reads RUN/chat_template.jinja (no tokenizer_config.json
    beside it): rendered as the run rendered it, Mistral's eos_token included (it stopped with
    'eos_token' is undefined)."""
    ours, theirs = _pair(hf_folders["chatml_generation"])
    source = (hf_folders["mistral"] / "tokenizer_config.json").read_text()
    import json

    source = json.loads(source)["chat_template"]
    template = templates.from_text(source, "RUN/chat_template.jinja", ours)
    for conv in _conversations("mistral"):
        text, _ = template.render(conv)
        assert text == theirs.apply_chat_template(conv, chat_template=source, tokenize=False)
        assert "</s>" in text


def test_a_jinja_file_needing_a_token_the_tokenizer_cannot_write_is_refused(tmp_path):
    file = tmp_path / "bos.jinja"
    file.write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with pytest.raises(DataError, match=r"bos.jinja writes bos_token, which the ByteTokenizer"):
        templates.resolve(str(file), ByteTokenizer())


def test_a_missing_template_file_is_named_as_missing_and_an_unknown_name_lists_the_names(
        tmp_path):
    with pytest.raises(DataError, match=r"nope.jinja'?: no such file or folder"):
        templates.resolve(str(tmp_path / "nope.jinja"), ByteTokenizer())
    with pytest.raises(DataError, match=r"'chatm': not a named template \(chatml"):
        templates.resolve("chatm", ByteTokenizer())


def test_a_template_file_that_is_not_utf8_is_one_line(tmp_path):
    file = tmp_path / "latin1.jinja"
    file.write_bytes("{{ 'café' }}".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jinja: a chat template must be UTF-8 text"):
        templates.resolve(str(file), ByteTokenizer())


@pytest.mark.parametrize("name", ["llama3", "qwen2_5", "mistral"])
def test_prefix_spans_equal_the_generation_spans(hf_folders, name):
    """Without {% generation %}: each assistant span is exactly its content and end-of-turn
    text (checked by decoding the masked tokens)."""
    ours, _ = _pair(hf_folders[name])
    template = templates.resolve("", ours)
    end = {"llama3": "<|eot_id|>", "qwen2_5": "<|im_end|>\n", "mistral": "</s>"}[name]
    for conv in _conversations(name):
        text, spans = masks.assistant_spans(template, conv, "row")
        answers = [m["content"] for m in conv if m["role"] == "assistant"]
        strip = name == "llama3"  # its template trims each message
        assert [text[a:b] for [(a, b)] in spans] == [
            (c.strip() if strip else c) + end for c in answers]


def test_train_on_last_and_all(hf_folders):
    ours, _ = _pair(hf_folders["chatml_generation"])
    template = templates.resolve("", ours)
    conv = CONVERSATIONS[1]
    _, every = masks.encode(template, ours, conv, "assistant", "row", bos=False)
    _, last = masks.encode(template, ours, conv, "last_assistant", "row", bos=False)
    _, whole = masks.encode(template, ours, conv, "all", "row", bos=False)
    assert whole.all() and last.sum() < every.sum() and (every | last).sum() == every.sum()
    ids, _ = masks.encode(template, ours, conv, "all", "row", bos=False)
    assert ours.decode(ids[last], skip_special=False) == "Two, the only one.<|im_end|>"


def test_byte_tokenizer_with_chatml_masks_exactly_the_answer():
    tok = ByteTokenizer()
    ids, mask = masks.encode(templates.resolve("chatml", tok), tok, CONVERSATIONS[2],
                             "assistant", "row", bos=True)
    assert ids[0] == tok.bos_id and not mask[0]
    picked = bytes(int(i) for i in ids[mask]).decode()
    assert picked == " spaced  answer \n<|im_end|>done<|im_end|>"


def test_a_template_that_rewrites_earlier_turns_is_an_error_not_a_full_mask():
    bad = templates.ChatTemplate(
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}"
        "{% if loop.last %} (n={{ messages|length }}){% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}", "moving.jinja")
    with pytest.raises(DataError, match="moving.jinja.*assistant turn 1 of file.jsonl: line 3 "
                       "cannot be located exactly"):
        masks.encode(bad, ByteTokenizer(), CONVERSATIONS[0], "assistant", "file.jsonl: line 3",
                     bos=False)


def test_a_template_that_fails_to_render_names_itself_and_the_row(hf_folders):
    ours, _ = _pair(hf_folders["mistral"])
    with pytest.raises(DataError, match="mistral.*fails to render f.jsonl: line 2: Conversation "
                       "roles must alternate"):
        masks.encode(templates.resolve("", ours), ours, CONVERSATIONS[1], "assistant",
                     "f.jsonl: line 2", bos=False)


def test_no_template_names_the_folder_and_the_fix(tmp_path):
    from tests.components.data.chat.conftest import make_folder

    folder = make_folder(tmp_path / "plain", "")
    tok = HuggingFaceTokenizer(HuggingFaceTokenizerConfig(type="huggingface", path=str(folder)))
    with pytest.raises(DataError, match="no chat template.*data.template"):
        templates.resolve("", tok)
    with pytest.raises(DataError, match="has none; set data.template"):
        templates.resolve("", ByteTokenizer())

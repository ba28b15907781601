"""Multiple choice: the harness's acc / acc_norm / acc_bytes, answers as index / label / letter,
presets, few-shot, truncation, and log-likelihoods equal to a plain forward per choice (with and
without sharing the context through the KV cache)."""

from __future__ import annotations

import pytest
import torch

from kiln.components.errors import DataError, RecipeError
from kiln.components.tasks import runner
from kiln.components.tasks.common import encode_pair
from tests.components.tasks import samples


class Fixed:
    """A scorer returning given log-likelihoods, one list per example in plan order."""

    def __init__(self, lls):
        self.lls = lls

    def loglikelihoods(self, groups):
        return [[(ll, False) for ll in self.lls.pop(0)] for _ in groups]


def test_acc_acc_norm_and_acc_bytes_as_the_harness_defines_them(tmp_path):
    rows = [{"context": "q", "choices": ["a", "bbbb"], "answer": 1},  # per char: -3 vs -1
            {"context": "q", "choices": ["éé", "xy"], "answer": 1}]  # per byte: -1 vs -1.5
    task = samples.task("multiple_choice", samples.write_jsonl(tmp_path / "t.jsonl", rows),
                        batch_size=1)
    plan = task.plan(samples.byte_tokenizer(), 64)
    order = [b.units[0] for b in plan.batches]
    lls = {0: [-3.0, -4.0], 1: [-4.0, -3.0]}
    result = runner.run(task, plan, Fixed([lls[u] for u in order]))
    # example 0: acc picks 0 (wrong), acc_norm picks 1 (right), acc_bytes picks 1 (right)
    # example 1: acc picks 1 (right); chars 2 vs 2: picks 1; bytes 4 vs 2: -1 vs -1.5 picks 0
    assert {k: v for k, v in result.items() if not k.endswith("_stderr")} == {
        "acc": 0.5, "acc_norm": 1.0, "acc_bytes": 0.5}
    assert result["acc_stderr"] == pytest.approx(0.5) and result["acc_norm_stderr"] == 0.0


def _brute(model, tokenizer, prompt: str, choice: str) -> float:
    ctx, cont = encode_pair(tokenizer, prompt, " " + choice, bos=True)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = model(ids[:, :-1]).float().log_softmax(-1)[0]  # the whole vocabulary
    return float(sum(logp[len(ctx) - 1 + j, t] for j, t in enumerate(cont)))


@pytest.mark.parametrize("use_cache", [True, False])
def test_loglikelihoods_equal_a_forward_per_choice(tmp_path, use_cache):
    data = samples.rows(7)
    task = samples.task("multiple_choice", samples.write_jsonl(tmp_path / "t.jsonl", data),
                        batch_size=3)
    tok, model = samples.byte_tokenizer(), samples.tiny_model()
    plan = task.plan(tok, 128)
    scorer = samples.scorer(model, use_cache=use_cache)
    assert scorer.use_cache == use_cache
    for batch in plan.batches:
        for unit, lls in zip(batch.units, task.loglikelihoods(scorer, batch), strict=True):
            want = [_brute(model, tok, data[unit]["context"], c) for c in data[unit]["choices"]]
            assert lls == pytest.approx(want, abs=1e-4)


def test_answers_by_label_letter_number_and_text(tmp_path):
    rows = [{"q": "a", "c": {"text": ["x", "y"], "label": ["1", "2"]}, "k": "2"},
            {"q": "b", "c": {"text": ["x", "y"], "label": ["A", "B"]}, "k": "B"},
            {"q": "c", "c": {"text": ["x", "y"], "label": ["P", "Q"]}, "k": "y"}]
    task = samples.task("multiple_choice", samples.write_jsonl(tmp_path / "t.jsonl", rows),
                        fields={"context": "q", "choices": "c.text", "labels": "c.label",
                                "answer": "k"})
    plan = task.plan(samples.byte_tokenizer(), 64)
    assert sorted(ex.answer for b in plan.batches for ex in b.payload) == [1, 1, 1]


@pytest.mark.parametrize("answer, message", [
    (5, r"example 1 \(the file's 2nd\): answer 5 is out of range: the example has 2 "
        r"choices \(0..1\)"),
    ("zz", r"example 1 \(the file's 2nd\): answer 'zz' is not a choice index, label, letter "
           "or choice text"),
])
def test_bad_answers_name_task_file_and_example(tmp_path, answer, message):
    rows = [{"context": "a", "choices": ["x", "y"], "answer": 0},
            {"context": "b", "choices": ["x", "y"], "answer": answer}]
    path = samples.write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(DataError, match=f"task 'mc': {path}: {message}"):
        samples.task("multiple_choice", path, name="mc").plan(samples.byte_tokenizer(), 64)


def test_a_missing_field_names_the_example(tmp_path):
    path = samples.write_jsonl(tmp_path / "t.jsonl", [{"context": "a", "answer": 0}])
    with pytest.raises(DataError, match=r"example 0 \(the file's 1st\): no field 'choices'"):
        samples.task("multiple_choice", path).plan(samples.byte_tokenizer(), 64)


def _prompts(task, tok, max_len=512):
    plan = task.plan(tok, max_len)
    by_unit = {u: ex for b in plan.batches for u, ex in zip(b.units, b.payload, strict=True)}
    out = []
    for u in sorted(by_unit):
        (ctx, conts), = by_unit[u].groups
        out.append((tok.decode(ctx), [tok.decode(c) for c in conts], by_unit[u].answer))
    return out


def test_presets_map_hugging_face_files(tmp_path):
    tok = samples.byte_tokenizer()
    arc = [{"id": "1", "question": "Why?", "choices": {"text": ["sun", "moon"],
                                                        "label": ["A", "B"]}, "answerKey": "B"}]
    task = samples.task("multiple_choice", samples.write_parquet(tmp_path / "a.parquet", arc),
                        preset="arc")
    assert _prompts(task, tok) == [("Question: Why?\nAnswer:", [" sun", " moon"], 1)]
    hs = [{"activity_label": "Cooking", "ctx": "He [title] stirs  the pot", "label": "0",
           "endings": ["then [step] eats.", "then sleeps."]}]
    task = samples.task("multiple_choice", samples.write_jsonl(tmp_path / "h.jsonl", hs),
                        preset="hellaswag")
    assert _prompts(task, tok) == [("Cooking: He. stirs the pot", [" then eats.",
                                                                   " then sleeps."], 0)]
    piqa = [{"goal": "Open a jar", "sol1": "twist", "sol2": "push", "label": 0}]
    task = samples.task("multiple_choice", samples.write_jsonl(tmp_path / "p.jsonl", piqa),
                        preset="piqa")
    assert _prompts(task, tok) == [("Question: Open a jar\nAnswer:", [" twist", " push"], 0)]
    mmlu = [{"question": "2+2?", "choices": ["3", "4"], "answer": 1, "subject": "math"}]
    task = samples.task("multiple_choice", samples.write_jsonl(tmp_path / "m.jsonl", mmlu),
                        preset="mmlu")
    assert _prompts(task, tok) == [("2+2?\nA. 3\nB. 4\nAnswer:", [" A", " B"], 1)]


def test_preset_errors_surface_in_the_recipe(write):
    from kiln.recipes.config.files import load_recipe

    base = 'extends = "{}"\n[evals.x]\ntype = "exact_match"\n'.format(
        str(samples.Path(__file__).parents[3] / "train_configs" / "debug.toml"))
    with pytest.raises(RecipeError, match=r"\[evals.x\]: preset 'arc' is a multiple_choice task"):
        load_recipe(write("a.toml", base + 'preset = "arc"\n'))
    with pytest.raises(RecipeError, match=r"unknown preset 'arcc' \(did you mean 'arc'\?\)"):
        load_recipe(write("b.toml", base.replace("exact_match", "multiple_choice")
                          + 'preset = "arcc"\n'))
    with pytest.raises(RecipeError, match="fields: unknown name.* contxt .*valid: prompt, "
                                          "answer"):
        load_recipe(write("c.toml", base + 'fields = { contxt = "q" }\n'))
    recipe = load_recipe(write("d.toml", base.replace("exact_match", "multiple_choice")
                               + 'preset = "arc"\nfields = { context = "stem" }\n'))
    # the preset's values are in the resolved recipe; keys the table set win
    assert recipe.evals["x"].template == "Question: {context}\nAnswer:"
    assert recipe.evals["x"].fields["context"] == "stem"
    assert recipe.evals["x"].fields["choices"] == "choices.text"


def test_few_shot_is_fixed_per_example_and_never_the_example_itself(tmp_path):
    data = samples.rows(6)
    path = samples.write_jsonl(tmp_path / "t.jsonl", data)
    tok = samples.byte_tokenizer()
    one = _prompts(samples.task("multiple_choice", path, num_fewshot=2), tok)
    again = _prompts(samples.task("multiple_choice", path, num_fewshot=2, limit=3), tok)
    assert one[:3] == again  # the draw depends on the example, not on limit or order
    for i, (prompt, _, _) in enumerate(one):
        shots = prompt.split("\n\n")
        assert len(shots) == 3 and shots[-1] == data[i]["context"]
        assert not any(s.startswith(data[i]["context"] + " ") for s in shots[:-1])
    other = _prompts(samples.task("multiple_choice", path, num_fewshot=2, fewshot_seed=7), tok)
    assert other != one
    with pytest.raises(DataError, match="num_fewshot = 6 but .* has only 5 other examples"):
        samples.task("multiple_choice", path, num_fewshot=6).plan(tok, 512)


def test_long_prompts_are_cut_from_the_left_and_counted(tmp_path):
    rows = [{"context": "x" * 100, "choices": ["ab", "c"], "answer": 0},
            {"context": "short", "choices": ["ab", "c"], "answer": 0}]
    path = samples.write_jsonl(tmp_path / "t.jsonl", rows)
    plan = samples.task("multiple_choice", path).plan(samples.byte_tokenizer(), 32)
    assert plan.truncated == 1 and plan.examples == 2
    cut = {len(ex.groups): ex.groups for batch in plan.batches for ex in batch.payload}
    # the harness's rule, per choice: context + choice keeps its last 33 tokens (the last one
    # is only predicted), so the shorter choice keeps one more token of context
    assert [(len(ctx), [len(c) for c in conts]) for ctx, conts in cut[2]] == [(30, [3]),
                                                                            (31, [2])]
    assert cut[1][0][0][0] == 256 and len(cut[1][0][1]) == 2  # not cut: one shared context
    with pytest.raises(DataError, match=r"example 0 \(the file's 1st\): a choice is 4 tokens, "
                                        r"longer than the model's context \(3\)"):
        samples.task("multiple_choice", samples.write_jsonl(tmp_path / "u.jsonl", [
            {"context": "a", "choices": ["abc", "d"], "answer": 0}])).plan(
            samples.byte_tokenizer(), 3)


@pytest.mark.parametrize("use_cache", [True, False])
def test_prompts_longer_than_the_context_are_cut_per_choice_as_the_harness_does(tmp_path,
                                                                                use_cache):
    """lm-evaluation-harness's ``hf`` model scores ``(context + choice)[-(max_len + 1):][:-1]``
    for each choice on its own: a shorter choice keeps more of the context."""
    data = samples.rows(9, seed=3)
    for i, row in enumerate(data):
        if i % 3:  # two of three prompts longer than the context; choices of unequal length
            row["context"] = " ".join([row["context"]] * 12)
        row["choices"] = [c * (1 + j) for j, c in enumerate(row["choices"])]
    task = samples.task("multiple_choice", samples.write_jsonl(tmp_path / "t.jsonl", data),
                        batch_size=4)
    tok, model, max_len = samples.byte_tokenizer(), samples.tiny_model(), 64
    plan = task.plan(tok, max_len)
    pairs = [[encode_pair(tok, row["context"], " " + c, bos=True) for c in row["choices"]]
             for row in data]
    assert plan.truncated == sum(any(len(a) + len(b) > max_len + 1 for a, b in p)
                                 for p in pairs) >= 6
    scorer = samples.scorer(model, max_len=max_len, use_cache=use_cache)
    for batch in plan.batches:
        for unit, lls in zip(batch.units, task.loglikelihoods(scorer, batch), strict=True):
            want = []
            for ctx, cont in pairs[unit]:
                ids = torch.tensor([(ctx + cont)[-(max_len + 1):][:-1]])
                with torch.no_grad():
                    logp = model(ids).float().log_softmax(-1)[0, -len(cont):]
                want.append(float(logp.gather(1, torch.tensor(cont)[:, None]).sum()))
            assert lls == pytest.approx(want, abs=1e-4)

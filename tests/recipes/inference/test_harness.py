"""kiln against lm-evaluation-harness on a tiny Llama saved by transformers (made here) and local
task YAMLs over local JSONL files: kiln's own multiple-choice task gives the harness ``hf``
model's per-example log-likelihoods (1e-4) and the same acc / acc_norm; kiln's exact-match
task generates the harness's ``generate_until`` outputs; the ``kiln`` harness model gives the
same again; ``kiln harness`` prints the harness's table."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kiln.components.tasks import runner
from tests.conftest import REPO

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the harness's hf model imports it

pytestmark = pytest.mark.slow


def _bench():
    spec = importlib.util.spec_from_file_location("bench_eval", REPO / "scripts" / "bench_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", autouse=True)
def _one_task_index():
    """Every harness run of this module (the helpers' and ``kiln harness``'s own) makes a
    TaskManager, which indexes lm-eval's ~14,700 built-in task YAMLs and the folders it is given
    (tens of seconds on a 2-core machine). Here the built-in folder is left out (no test names a
    built-in task) and each other folder is indexed once, merged as the harness does (a later
    folder's names win). The runs get a dict of their own; no run changes an entry (the task
    factory deep-copies its config). Nor is the environment report collected (below)."""
    from pathlib import Path

    from lm_eval.tasks import _index
    from torch.utils import collect_env

    real, built = _index.TaskIndex.build, {}
    builtin = Path(_index.__file__).resolve().parent  # lm-eval's own task folder

    def build(paths, **kw):
        index = {}
        for root in paths:
            if Path(root).resolve() == builtin:
                continue
            key = (str(root), tuple(sorted(kw.items())))
            if key not in built:
                built[key] = real([root], **kw)
            index.update(built[key])
        return index

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_index.TaskIndex, "build", staticmethod(build))
        # the environment report every harness run adds to its results runs `pip list`, lscpu
        # and more in subprocesses (about 1 s each run here); no test reads it
        mp.setattr(collect_env, "get_pretty_env_info", lambda: "(not collected in tests)")
        yield built


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    b = _bench()
    tmp = tmp_path_factory.mktemp("harness")
    folder = b.save_model(tmp / "model")  # 300 ids: the tokenizer's vocabulary fills it
    # 512 rows, more than the tokenizer learns (370): log-likelihoods count the rows past it, as
    # the harness does (greedy decoding stays on the tokenizer's ids, so generation is compared
    # on the full model above)
    b.save_model(tmp / "model512", vocab=512)
    b.write_mc(tmp / "tasks", 12, context=(3, 25), ending=(1, 6))
    b.write_em(tmp / "tasks", 6)
    return b, folder, tmp / "tasks"


def _by_doc(samples: list[dict]) -> dict[int, dict]:
    return {s["doc_id"]: s for s in samples}


def test_multiple_choice_and_generation_equal_the_harness_hf_model(setup):
    b, folder, tasks = setup
    padded = folder.parent / "model512"
    hf = b.harness(b.hf_model(padded, 4), ["kiln_mc"], tasks)
    scorer, tokenizer = b.kiln_scorer(padded)
    assert tokenizer.vocab_size < scorer.model.vocab_size == 512

    mc = b.kiln_task("multiple_choice", tasks / "mc.jsonl", batch_size=5)
    plan = mc.plan(tokenizer, scorer.max_len)
    mine = {u: lls for batch in plan.batches
            for u, lls in zip(batch.units, mc.loglikelihoods(scorer, batch), strict=True)}
    theirs = _by_doc(hf["samples"]["kiln_mc"])
    assert set(mine) == set(theirs) == set(range(12))
    for doc, lls in mine.items():
        assert lls == pytest.approx([r[0] for r in theirs[doc]["filtered_resps"]], abs=1e-4)
    metrics = runner.run(mc, plan, scorer)
    assert metrics["acc"] == hf["results"]["kiln_mc"]["acc,none"]
    assert metrics["acc_norm"] == hf["results"]["kiln_mc"]["acc_norm,none"]
    assert 0 < metrics["acc"] < 1 or 0 < metrics["acc_norm"] < 1  # not a degenerate case

    hf = b.harness(b.hf_model(folder, 4), ["kiln_em"], tasks)
    scorer, tokenizer = b.kiln_scorer(folder)
    em = b.kiln_task("exact_match", tasks / "em.jsonl", batch_size=4, stop=[".", "fire"],
                     max_new_tokens=12)
    plan = em.plan(tokenizer, scorer.max_len)
    texts = {u: t for batch in plan.batches
             for u, t in zip(batch.units, em.generations(scorer, batch), strict=True)}
    generated = {d: s["resps"][0][0] for d, s in _by_doc(hf["samples"]["kiln_em"]).items()}
    assert texts == generated and any(texts.values())
    assert runner.run(em, plan, scorer)["exact_match"] == \
        hf["results"]["kiln_em"]["exact_match,none"]


@pytest.fixture(scope="module")
def kiln_export(tmp_path_factory):
    """A kiln run (byte tokenizer, 128-token context), its ``kiln export``, and a task whose
    prompts are all longer than the context (~250-400 tokens) with choices of 1-10 words."""
    from kiln.recipes.cli import main
    from tests.recipes.test_combinations import recipe_for, train

    folder = tmp_path_factory.mktemp("kiln_export")
    train(recipe_for("dense", folder / "run", "--training.seq_len=128",
                     "--checkpoint.enable=true"))
    assert main(["export", str(folder / "run"), str(folder / "export")]) == 0
    _bench().write_mc(folder / "tasks", 6, context=(55, 80), ending=(1, 10))
    return folder


def test_prompts_longer_than_the_context_score_as_the_hf_model_on_a_kiln_export(kiln_export,
                                                                              capsys):
    """kiln eval --tasks (its scorer on the opened export) and the kiln harness model give the
    harness hf model's per-choice log-likelihoods, each choice cut on its own."""
    from kiln.recipes.cli import main
    from kiln.recipes.inference.harness_model import KilnLM

    b, export, tasks = _bench(), kiln_export / "export", kiln_export / "tasks"
    hf = b.harness(b.hf_model(export, 4), ["kiln_mc"], tasks)
    want = {d: [r[0] for r in s["filtered_resps"]] for d, s in _by_doc(
        hf["samples"]["kiln_mc"]).items()}
    scorer, tokenizer = b.kiln_scorer(export)
    assert scorer.max_len == 128
    mc = b.kiln_task("multiple_choice", tasks / "mc.jsonl", batch_size=4)
    plan = mc.plan(tokenizer, scorer.max_len)
    assert plan.truncated == plan.examples == 6
    mine = {u: lls for batch in plan.batches
            for u, lls in zip(batch.units, mc.loglikelihoods(scorer, batch), strict=True)}
    ours = b.harness(KilnLM(path=str(export), batch_size=3), ["kiln_mc"], tasks)
    harness = {d: [r[0] for r in s["filtered_resps"]] for d, s in _by_doc(
        ours["samples"]["kiln_mc"]).items()}
    assert set(mine) == set(harness) == set(want) == set(range(6))
    for doc, lls in want.items():
        assert mine[doc] == pytest.approx(lls, abs=1e-4)
        assert harness[doc] == pytest.approx(lls, abs=1e-4)
    file = tasks / "mc.toml"
    file.write_text(f'[evals.mc]\ntype = "multiple_choice"\npath = "{tasks / "mc.jsonl"}"\n')
    assert main(["eval", str(export), "--tasks", "mc", "--task-file", str(file), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["tasks"]["mc"]
    assert result["truncated"] == 6
    assert result["metrics"]["acc"] == hf["results"]["kiln_mc"]["acc,none"]
    assert result["metrics"]["acc_norm"] == hf["results"]["kiln_mc"]["acc_norm,none"]
    for metric in ("acc", "acc_norm"):  # the standard errors as the harness reports them
        assert result["metrics"][f"{metric}_stderr"] == pytest.approx(
            hf["results"]["kiln_mc"][f"{metric}_stderr,none"], rel=1e-9)


def test_the_kiln_harness_model_equals_the_hf_model(setup):
    from kiln.recipes.inference.harness_model import KilnLM

    b, folder, tasks = setup
    hf = b.harness(b.hf_model(folder, 4), ["kiln_mc", "kiln_em"], tasks)
    ours = b.harness(KilnLM(path=str(folder), batch_size=3), ["kiln_mc", "kiln_em"], tasks)
    for task in ("kiln_mc", "kiln_em"):
        want, got = _by_doc(hf["samples"][task]), _by_doc(ours["samples"][task])
        for doc in want:
            if task == "kiln_mc":
                assert [r[0] for r in got[doc]["filtered_resps"]] == pytest.approx(
                    [r[0] for r in want[doc]["filtered_resps"]], abs=1e-4)
            else:
                assert got[doc]["resps"] == want[doc]["resps"]
        for key, value in hf["results"][task].items():
            if key.endswith(",none") and "stderr" not in key:
                assert ours["results"][task][key] == value, (task, key)


def test_rolling_log_likelihood_equals_the_bits_per_byte_task(setup, tmp_path):
    import math

    from lm_eval.api.instance import Instance

    from kiln.recipes.inference.harness_model import KilnLM

    b, folder, _ = setup
    text = "the cat sat on the mat with the big red hat " * 40  # longer than one window
    lm = KilnLM(path=str(folder), max_length=64)
    (ll,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    (tmp_path / "doc.jsonl").write_text(json.dumps({"text": text}) + "\n")
    task = b.kiln_task("bits_per_byte", tmp_path / "doc.jsonl")
    bpb = runner.run(task, task.plan(lm.tokenizer_, 64), lm.scorer)["bits_per_byte"]
    assert -ll == pytest.approx(bpb * math.log(2) * len(text.encode()), rel=1e-6)


def test_model_args_win_over_the_harness_batch_size_and_device(setup):
    from kiln.recipes.inference.harness_model import KilnLM

    _, folder, _ = setup
    harness_own = {"batch_size": 1, "max_batch_size": None, "device": "cpu"}
    lm = KilnLM.create_from_arg_string(f"path={folder},batch_size=5,device=cpu", harness_own)
    assert lm.batch_size == 5
    lm = KilnLM.create_from_arg_obj({"path": str(folder), "batch_size": 6}, harness_own)
    assert lm.batch_size == 6
    assert KilnLM.create_from_arg_string(f"path={folder}", harness_own).batch_size == 1


def test_kiln_harness_help_tells_the_kiln_model_and_its_arguments(capsys):
    from kiln.recipes.cli import main
    from kiln.recipes.inference.harness_model import MODEL_ARGS

    assert main(["harness", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--model kiln --model_args path=RUN" in out
    assert all(f"  {name}" in out for name in MODEL_ARGS)
    assert "lm-eval run --model hf" in out  # the harness's own help follows


def test_kiln_harness_command_prints_the_results_table(setup, capsys, monkeypatch):
    from kiln.recipes.cli import main

    b, folder, tasks = setup
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert main(["harness", "--model", "kiln", "--model_args", f"path={folder}", "--tasks",
                 str(tasks / "mc.yaml"), "--device", "cpu", "--batch_size", "4"]) == 0
    out = capsys.readouterr().out
    assert "|kiln_mc|" in out and "acc_norm" in out
    assert main(["eval", str(folder), "--harness", str(tasks / "mc.yaml")]) == 0
    assert "|kiln_mc|" in capsys.readouterr().out
    # batch_size and device in --model_args too (as docs/evaluation.md shows): they win over
    # the harness's own --batch_size / --device, which it always passes (batch 1 by default)
    assert main(["harness", "--model", "kiln", "--model_args",
                 f"path={folder},batch_size=16,device=cpu", "--tasks", str(tasks / "mc.yaml"),
                 "--device", "cpu"]) == 0
    assert "|kiln_mc|" in capsys.readouterr().out
    assert main(["harness", "--model", "kiln", "--tasks", str(tasks / "mc.yaml")]) == 2
    assert "needs --model_args path=RUN" in capsys.readouterr().err
    assert main(["harness", "--model", "kiln", "--model_args", f"path={folder},btach_size=2",
                 "--tasks", str(tasks / "mc.yaml")]) == 2
    assert "unknown argument(s) btach_size for the kiln model" in capsys.readouterr().err
    # the harness's own refusal of a task name is one line too, not its ValueError traceback
    assert main(["harness", "--model", "kiln", "--model_args", f"path={folder}", "--tasks",
                 "no_such_task"]) == 2
    err = capsys.readouterr().err
    assert "lm-evaluation-harness: Tasks not found: no_such_task; `kiln harness ls tasks`" in err
    assert "Traceback" not in err

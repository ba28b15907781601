"""A streaming_text run stopped with SIGTERM and rerun continues with the same losses as an
uninterrupted run: in one process, and (slow) in two processes (forked ranks)."""

from __future__ import annotations

import pytest

from kiln.components.errors import KilnError
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests import forked
from tests.checkpointing.test_exact_resume import TINY, Record, cut_and_resume, losses
from tests.components.data.corpora import write_jsonl, write_parquet
from tests.components.tokenizers.tokenizer_files import stdlib_texts
from tests.conftest import CONFIGS


def _corpus(folder):
    docs = list(stdlib_texts())
    write_jsonl(folder / "a.jsonl", docs[:15])
    write_parquet(folder / "b.parquet", docs[15:])
    return folder


def _streaming(corpus):
    keep = [o for o in TINY if not o.startswith("--data.")]
    return [*keep, "--data.type=streaming_text", f"--data.inputs=[\"{corpus}\"]",
            "--data.eval_docs=2", "--data.batch_docs=4"]


def run(folder, corpus, steps, signal_at=None, extra=()):
    import io

    recipe = load_recipe(CONFIGS / "debug.toml", [*_streaming(corpus), f"--training.steps={steps}",
                                                  f"--run.folder={folder}", *extra])
    rec = Record(signal_at)
    trainer = Trainer(recipe, hooks=[rec], out=io.StringIO())
    trainer.fit()
    return rec, trainer


def test_streaming_stop_and_resume_gives_identical_losses(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    full, _ = run(tmp_path / "full", corpus, 8)
    first, t1 = run(tmp_path / "cut", corpus, 8, signal_at=2)
    assert t1.stop_requested and max(first.losses) == 3
    # the recipe check lets loader settings change (checkpointing/resume.py); this cursor
    # records its workers and refuses other ones itself, leaving the run as it was
    with pytest.raises(KilnError, match="saved with num_workers = 0, this loader has 2; "):
        run(tmp_path / "cut", corpus, 8, extra=["--data.num_workers=2"])
    second, _ = run(tmp_path / "cut", corpus, 8)
    assert min(second.losses) == 4
    assert {**first.losses, **second.losses} == full.losses
    assert full.evals and second.evals[6] == full.evals[6]


@pytest.mark.slow
def test_two_process_streaming_run_resumes_exactly(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    steps = 30
    # the uninterrupted reference: the same two ranks, forked
    forked.train_ranks([str(CONFIGS / "debug.toml"), *_streaming(corpus),
                        f"--training.steps={steps}", f"--run.folder={tmp_path / 'full'}"],
                       2, tmp_path / "full_logs")
    first, stopped, again = cut_and_resume(tmp_path / "cut", [*_streaming(corpus),
                                                              f"--training.steps={steps}"])
    assert stopped < steps, "the run finished before the signal arrived"
    assert "stopped at step" in first.stdout and "resumed from" in again.stdout
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")

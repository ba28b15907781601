"""A streaming_text run stopped with SIGTERM and rerun continues with the same losses as an
uninterrupted run: in one process, and (slow) in two processes under torchrun."""

from __future__ import annotations

import pytest

from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests import forked
from tests.checkpointing.test_exact_resume import TINY, Record, _workers, losses
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


def run(folder, corpus, steps, signal_at=None):
    import io

    recipe = load_recipe(CONFIGS / "debug.toml", [*_streaming(corpus), f"--training.steps={steps}",
                                                  f"--run.folder={folder}"])
    rec = Record(signal_at)
    trainer = Trainer(recipe, hooks=[rec], out=io.StringIO())
    trainer.fit()
    return rec, trainer


def test_streaming_stop_and_resume_gives_identical_losses(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    full, _ = run(tmp_path / "full", corpus, 8)
    first, t1 = run(tmp_path / "cut", corpus, 8, signal_at=2)
    assert t1.stop_requested and max(first.losses) == 3
    second, _ = run(tmp_path / "cut", corpus, 8)
    assert min(second.losses) == 4
    assert {**first.losses, **second.losses} == full.losses
    assert full.evals and second.evals[6] == full.evals[6]


def _torchrun(folder, corpus, steps, port):
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
           f"--master-port={port}", "-m", "kiln.recipes.cli", "train", str(CONFIGS / "debug.toml"),
           *_streaming(corpus), f"--training.steps={steps}", f"--run.folder={folder}"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_two_process_streaming_run_resumes_exactly(tmp_path):
    import os
    import signal
    import time

    from tests.parallelisms.tiny import free_port as _free_port

    corpus = _corpus(tmp_path / "corpus")
    steps = 30
    # the uninterrupted reference: the same two ranks, forked (the launch is tested below)
    forked.train_ranks([str(CONFIGS / "debug.toml"), *_streaming(corpus),
                        f"--training.steps={steps}", f"--run.folder={tmp_path / 'full'}"],
                       2, tmp_path / "full_logs")
    cut = _torchrun(tmp_path / "cut", corpus, steps, _free_port())
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        metrics = tmp_path / "cut" / "metrics.jsonl"
        if metrics.exists() and len(losses(tmp_path / "cut")) >= 6:
            break
        time.sleep(0.05)
    os.kill(_workers(cut.pid)[-1], signal.SIGTERM)
    out, _ = cut.communicate(timeout=300)
    assert cut.returncode == 0, out[-3000:]
    assert max(losses(tmp_path / "cut")) < steps, "the run finished before the signal arrived"
    again = _torchrun(tmp_path / "cut", corpus, steps, _free_port())
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0 and "resumed from" in out, out[-3000:]
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")

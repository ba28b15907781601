"""Training on ``train_configs/mixture_debug.toml`` at tiny sizes: per-source figures in the
metrics, the per-source loss against a hand computation, and a run stopped mid-stage or at the
stage switch that resumes to the uninterrupted run's losses bit for bit."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.checkpointing.test_exact_resume import Record
from tests.conftest import CONFIGS, REPO

SWITCH = 6  # the second stage's first step (0-based: steps taken before it)
TINY = [
    "--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
    "--model.ffn.hidden_dim=64", "--training.seq_len=32", "--training.global_batch=8",
    "--training.micro_batch=2", "--run.log_interval=1", "--run.progress_bar=false",
    "--run.tensorboard=false", "--eval.interval=4", "--eval.tokens=256",
    "--optimizer.lr=3e-3", "--checkpoint.interval=3", "--optimizer.schedule.warmup_steps=2",
    "--data.sources.code.max_bytes=200000", "--data.sources.tests.max_bytes=200000",
    "--data.sources.docstrings.max_bytes=60000", "--data.sources.docstrings.eval_fraction=0.2",
    f"--data.stages=[{{step = {SWITCH}, weights = {{docstrings = 3, code = 1}}}}]",
]


def _run(folder, steps=10, signal_at=None, extra=()):
    recipe = load_recipe(CONFIGS / "mixture_debug.toml",
                         [*TINY, f"--training.steps={steps}", f"--run.folder={folder}", *extra])
    rec = Record(signal_at)
    trainer = Trainer(recipe, hooks=[rec], out=io.StringIO())
    trainer.fit()
    return rec, trainer


def _metrics(folder) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], {}).update(row)
    return out


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixture") / "full"
    rec, trainer = _run(folder)
    return folder, rec, trainer


def test_every_logged_step_has_each_sources_loss_tokens_and_share(full):
    folder, _, trainer = full
    rows = _metrics(folder)
    names = trainer.dataset.source_names
    assert names == ["code", "docstrings", "tests"]
    for step in (1, 5, 10):
        for n in names:
            assert f"data/tokens/{n}" in rows[step] and f"data/share/{n}" in rows[step]
        assert sum(rows[step][f"data/share/{n}"] for n in names) == pytest.approx(1.0)
    assert "train/loss/tests" in rows[SWITCH] and "train/loss/tests" not in rows[SWITCH + 1]
    assert rows[10]["data/share/docstrings"] > 0.5  # the second stage's weights
    tokens = {n: rows[10][f"data/tokens/{n}"] for n in names}
    assert sum(tokens.values()) == 10 * 8 * 32
    for step in (4, 8, 10):
        evals = [rows[step][f"eval/loss/{n}"] for n in names]
        assert all(e > 0 for e in evals) and f"eval/bpb/{names[0]}" in rows[step]
        assert min(evals) <= rows[step]["eval/loss"] <= max(evals)


def test_source_tokens_count_what_a_context_warmup_trained_on(tmp_path):
    warm = ["--training.context_warmup.steps=4", "--training.context_warmup.start=8",
            "--training.context_warmup.multiple=8", "--eval.interval=0",
            "--checkpoint.interval=0"]
    _run(tmp_path / "warm", steps=8, extra=warm)
    rows = _metrics(tmp_path / "warm")
    for step in range(1, 9):
        got = sum(v for k, v in rows[step].items() if k.startswith("data/tokens/"))
        assert got == rows[step]["tokens_seen"] < step * 8 * 32, step


def test_the_per_source_loss_is_the_mean_over_that_sources_tokens(tmp_path):
    recipe = load_recipe(CONFIGS / "mixture_debug.toml",
                         [*TINY, "--training.steps=1", "--data.stages=[]",
                          f"--run.folder={tmp_path / 'one'}"])
    trainer = Trainer(recipe, out=io.StringIO())
    model = trainer.model
    loader = trainer.dataset.loader("train", micro_batch=8, global_batch=8)
    batch = next(loader)
    with torch.no_grad():
        logits = model(batch["input_ids"])
        per_row = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                  reduction="none").view(8, 32).mean(1)
    want = {n: per_row[batch["source_ids"] == i].mean().item()
            for i, n in enumerate(trainer.dataset.source_names) if (batch["source_ids"] == i).any()}
    trainer.fit()
    got = _metrics(tmp_path / "one")[1]
    assert len(want) >= 2
    for n, value in want.items():
        assert got[f"train/loss/{n}"] == pytest.approx(value, rel=1e-5), n
    assert got["loss"] == pytest.approx(per_row.mean().item(), rel=1e-5)


@pytest.mark.parametrize("stop_at", [4, SWITCH], ids=["mid-stage", "at the stage switch"])
def test_a_stopped_mixture_run_resumes_to_the_same_losses(full, tmp_path, stop_at):
    folder, ref, _ = full
    cut = tmp_path / "cut"
    first, t1 = _run(cut, signal_at=stop_at - 1)  # SIGTERM: saves at the next step, stops
    assert t1.stop_requested and max(first.losses) == stop_at
    second, _ = _run(cut)
    assert min(second.losses) == stop_at + 1
    assert {**first.losses, **second.losses} == ref.losses
    want, got = _metrics(folder), _metrics(cut)
    for step in range(stop_at + 1, 11):
        for key, value in want[step].items():
            if key.startswith(("train/loss/", "data/", "eval/loss")):
                assert got[step][key] == value, (step, key)


_KILLED = """
import io, os, signal, sys
from kiln.components.protocols import Hook
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer

class Kill(Hook):
    def on_step_end(self, trainer, result):
        if trainer.progress.step == int(sys.argv[1]):
            os.kill(os.getpid(), signal.SIGKILL)

recipe = load_recipe(sys.argv[2], sys.argv[3:])
Trainer(recipe, hooks=[Kill()], out=io.StringIO()).fit()
"""


@pytest.mark.slow
@pytest.mark.parametrize("kill_at", [5, SWITCH + 1], ids=["in stage 1", "in stage 2"])
def test_a_mixture_run_killed_with_sigkill_resumes_to_the_same_losses(full, tmp_path, kill_at):
    import sys

    from tests import forked

    folder, ref, _ = full
    cut = tmp_path / "cut"
    args = [*TINY, "--training.steps=10", f"--run.folder={cut}"]
    done = forked.run([sys.executable, "-c", _KILLED, str(kill_at),
                       str(CONFIGS / "mixture_debug.toml"), *args], REPO, timeout=300)
    assert done.returncode == -9, done.stderr[-3000:]
    assert max(_metrics(cut)) == kill_at  # the metrics of every completed step are there
    _run(cut)
    want, got = _metrics(folder), _metrics(cut)
    assert {s: r["loss"] for s, r in got.items() if "loss" in r} == ref.losses
    for step in range(kill_at + 1, 11):
        assert got[step]["train/loss/docstrings"] == want[step]["train/loss/docstrings"]


def test_the_chunked_loss_gives_the_same_per_source_losses(tmp_path):
    rows = {}
    for chunk in (0, 24):
        folder = tmp_path / f"chunk{chunk}"
        recipe = load_recipe(CONFIGS / "mixture_debug.toml", [
            *TINY, "--training.steps=2", "--data.stages=[]", f"--run.folder={folder}",
            f"--training.loss_chunk_tokens={chunk}", "--eval.interval=0", "--eval.at_end=false"])
        Trainer(recipe, out=io.StringIO()).fit()
        rows[chunk] = {s: {k: v for k, v in r.items() if k.startswith("train/loss/")}
                       for s, r in _metrics(folder).items()}
    assert rows[0][2] and rows[0][2].keys() == rows[24][2].keys()
    for step in (1, 2):
        assert rows[24][step] == pytest.approx(rows[0][step], rel=1e-5), step


class _Moments:
    """At train start (after the load): each optimizer's first-moment tensors, copied."""

    def __init__(self):
        self.moments: list[torch.Tensor] = []

    def on_train_start(self, trainer):
        from kiln.checkpointing.app_state import optimizers_of

        for opt in optimizers_of(trainer).values():
            self.moments += [s["exp_avg"].clone() for s in opt.state.values() if "exp_avg" in s]


@pytest.mark.parametrize("keep", [False, True], ids=["fresh optimizer", "kept optimizer"])
def test_a_new_stage_starts_from_a_finished_runs_checkpoint(full, tmp_path, keep):
    """The mid-training pattern: a finished run's weights (and, kept, its optimizer moments)
    start a new run on the anneal mix, whose data, step count and schedule begin afresh."""
    from kiln.checkpointing.app_state import optimizers_of

    folder, _, done = full
    anneal = tmp_path / "anneal"
    recipe = load_recipe(CONFIGS / "mixture_anneal.toml", [
        *[o for o in TINY if not o.startswith("--data.stages")], f"--run.folder={anneal}",
        "--training.steps=2", f"--checkpoint.resume={folder}/checkpoints/final",
        f"--checkpoint.keep_optimizer={str(keep).lower()}"])
    assert recipe.data.weights == {"docstrings": 0.7, "code": 0.3} and not recipe.data.stages
    moments, out = _Moments(), io.StringIO()
    trainer = Trainer(recipe, hooks=[moments], out=out)
    trainer.fit()
    assert "started from the weights of" in out.getvalue()
    assert ("kept optimizer state" in out.getvalue()) == keep
    saved = [s["exp_avg"] for o in optimizers_of(done).values() for s in o.state.values()]
    if keep:
        assert len(moments.moments) == len(saved) > 0
        assert all(torch.equal(a, b) for a, b in zip(moments.moments, saved, strict=True))
    else:
        assert moments.moments == []
    assert trainer.progress.step == 2  # its own steps, from 0
    counts = trainer.train_loader.source_counts()  # the anneal mix from its first sequence
    assert counts["tests"] == 0 and counts["code"] + counts["docstrings"] == 16
    assert counts == dict(zip(trainer.dataset.source_names,
                              trainer.dataset.counts_before(2, 8).tolist(), strict=True))
    assert _metrics(anneal)[2]["lr/main"] == pytest.approx(
        trainer.optimizers.lrs()["main"])  # its own schedule


def test_an_anneal_is_drawn_at_its_true_offset_and_joined_with_its_parent(full, tmp_path):
    """A model's life as one curve: the anneal records its parent (parent.json), is drawn from
    the parent's step and tokens on, and `kiln plot --join` draws both as one line; the
    parent's stage switch is logged (data/stage_start) and marked."""
    pytest.importorskip("matplotlib")
    from kiln.recipes.cli import main
    from kiln.recipes.runs import lineage
    from kiln.recipes.runs.read import open_run

    folder, _, done = full
    anneal = tmp_path / "anneal"
    recipe = load_recipe(CONFIGS / "mixture_anneal.toml", [
        *[o for o in TINY if not o.startswith("--data.stages")], f"--run.folder={anneal}",
        "--training.steps=2", f"--checkpoint.resume={folder}/checkpoints/final"])
    Trainer(recipe, out=io.StringIO()).fit()
    parent = json.loads((anneal / "parent.json").read_text())
    assert parent["step"] == 10 and parent["tokens"] == done.progress.tokens
    assert parent["how"] == "weights_only" and Path(parent["run"]) == folder.resolve()
    runs = [open_run(folder), open_run(anneal)]
    assert lineage.offset(runs[1], "step", runs) == 10.0
    assert lineage.offset(runs[1], "tokens", runs) == done.progress.tokens
    assert lineage.offset(runs[1], "time", runs) > 0 and lineage.offset(runs[0], "step") == 0
    assert lineage.lines(runs) == [[0, 1]] and lineage.lines(runs[::-1]) == [[1, 0]]
    assert lineage.stage_switches(runs[0]) == [SWITCH]
    assert main(["plot", str(folder), str(anneal), "--join", "--out", str(tmp_path / "j.png")]) \
        == 0
    assert (tmp_path / "j.png").stat().st_size > 10_000
    export = tmp_path / "export"
    export.mkdir()
    lineage.write_export_source(export, folder / "checkpoints" / "final")
    assert lineage.export_source(export)["step"] == 10  # a fine-tune of it finds its parent

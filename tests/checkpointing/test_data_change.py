"""Data that changed under a run: a resume on a source whose files were edited (same size
too), truncated or deleted is refused naming the source, or continues when the user says so;
mixture stages placed by fraction keep their step when training.steps changes."""

from __future__ import annotations

import io
import os

import pytest

from kiln.components.errors import CheckpointError
from kiln.components.protocols import Hook
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS
from tests.recipes.test_combinations import DENSE, TINY, train

ON = ("--checkpoint.enable=true", "--checkpoint.interval=2")


def _texts(folder, n=12, words=300):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(f"w{i}x{j}" for j in range(words)))


def _folder_recipe(texts, run, *extra):
    return load_recipe(CONFIGS / "debug.toml", [
        *TINY, *DENSE, *ON, "--data.source=folder", f"--data.source_path={texts}",
        f"--data.cache_dir={texts.parent / 'cache'}", f"--run.folder={run}", *extra])


def _same_size_edit(path):
    text = path.read_text()
    path.write_text(text.replace("w", "v", 1))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000))  # coarse clocks


@pytest.mark.parametrize("change", ["same-size edit", "truncate", "delete"])
def test_a_resume_on_changed_data_is_refused_naming_the_source(tmp_path, change):
    texts, run = tmp_path / "texts", tmp_path / "run"
    _texts(texts)
    train(_folder_recipe(texts, run, "--training.steps=4"))
    victim = texts / "doc03.txt"
    if change == "same-size edit":
        _same_size_edit(victim)
    elif change == "truncate":
        victim.write_text(victim.read_text()[:50])
    else:
        victim.unlink()
    with pytest.raises(CheckpointError, match=r"step_0000004: data changed since this "
                       r"checkpoint.*--checkpoint.on_data_change=continue") as err:
        train(_folder_recipe(texts, run, "--training.steps=6"))
    assert len(str(err.value).splitlines()) == 1
    go_on = _folder_recipe(texts, run, "--training.steps=6", "--checkpoint.on_data_change=continue")
    if change != "same-size edit":  # the cursor cannot point into data of another length
        with pytest.raises(CheckpointError, match="windows_per_epoch = 640, this loader has"):
            train(go_on)
        return
    out = io.StringIO()
    losses, _ = train(go_on, out=out)
    assert len(losses) == 2 and "data changed since step_0000004; continuing" in out.getvalue()


def test_unchanged_data_resumes_without_a_word(tmp_path):
    texts, run = tmp_path / "texts", tmp_path / "run"
    _texts(texts)
    train(_folder_recipe(texts, run, "--training.steps=4"))
    out = io.StringIO()
    losses, _ = train(_folder_recipe(texts, run, "--training.steps=6"), out=out)
    assert len(losses) == 2 and "data changed" not in out.getvalue()


def test_the_same_data_moved_elsewhere_resumes_and_other_data_there_is_refused(tmp_path):
    """Another machine's paths, a cache on a faster disk: data.source_path and data.cache_dir
    changed were refused as if the cursor pointed elsewhere, although the fingerprint checks
    what the data is."""
    import shutil

    texts, run = tmp_path / "texts", tmp_path / "run"
    _texts(texts)
    full, _ = train(_folder_recipe(texts, tmp_path / "full", "--training.steps=6"))
    train(_folder_recipe(texts, run, "--training.steps=4"))
    moved = tmp_path / "elsewhere" / "texts"
    shutil.copytree(texts, moved)
    out = io.StringIO()
    losses, _ = train(_folder_recipe(moved, run, "--training.steps=6",
                                     f"--data.cache_dir={tmp_path / 'cache2'}"), out=out)
    assert losses == full[4:]  # the same stream, bit for bit
    assert "data.source_path: " in out.getvalue() and "data.cache_dir: " in out.getvalue()
    _same_size_edit(moved / "doc03.txt")  # other data at the new place: still refused
    with pytest.raises(CheckpointError, match=r"step_0000006: data changed since this "):
        train(_folder_recipe(moved, run, "--training.steps=8",
                             f"--data.cache_dir={tmp_path / 'cache3'}"))


def _mixture_recipe(tmp_path, run, steps, *extra):
    for name in ("a", "b"):
        _texts(tmp_path / name, n=10)
    sources = [f"--data.sources.{n}.type=packed_documents" for n in ("a", "b")] + [
        f"--data.sources.{n}.source=folder" for n in ("a", "b")] + [
        f"--data.sources.{n}.source_path={tmp_path / n}" for n in ("a", "b")] + [
        f"--data.sources.{n}.cache_dir={tmp_path / 'cache'}" for n in ("a", "b")]
    keep = [o for o in TINY if not o.startswith(("--data.", "--training.steps"))]
    return load_recipe(CONFIGS / "debug.toml", [
        *keep, *DENSE, *ON, "--data.type=mixture", "--data.weights={a = 0.5, b = 0.5}",
        "--data.stages=[{fraction = 0.75, weights = {b = 1.0}}]", *sources,
        f"--training.steps={steps}", f"--run.folder={run}", *extra])


def test_a_stage_placed_by_fraction_stays_where_the_run_began_it(tmp_path):
    """A finished 8-step run (stage at step 6) rerun with 16 steps: the stage stays at 6 (it
    moved to 12, and steps 9-12 trained on the first stage's weights again)."""
    run = tmp_path / "run"
    train(_mixture_recipe(tmp_path, run, 8))
    out = io.StringIO()
    losses, trainer = train(_mixture_recipe(tmp_path, run, 16), out=out)
    assert len(losses) == 8
    assert [s.step for s in trainer.dataset.stages] == [0, 6]
    assert ("data.stages[0] (fraction 0.75) stays at step 6, where this run began it (in 16 "
            "steps it would begin at step 12)") in out.getvalue()


class StopAt(Hook):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, result) -> None:
        trainer.stop_requested = trainer.progress.step >= self.step


def _stopped(recipe, step: int, out) -> None:
    from kiln.recipes.training.trainer import Trainer

    Trainer(recipe, hooks=[StopAt(step)], out=out).fit()


def test_a_stage_still_to_come_moves_or_is_refused_if_it_would_never_run(tmp_path):
    run = tmp_path / "run"
    _stopped(_mixture_recipe(tmp_path, run, 16), 4, io.StringIO())  # stage at 12, not begun
    out = io.StringIO()
    _stopped(_mixture_recipe(tmp_path, run, 20), 6, out)
    assert "data.stages[0] (fraction 0.75) now begins at step 15 in 20 steps (was 12)" in (
        out.getvalue())
    with pytest.raises(CheckpointError, match=r"would now begin at step 4, at or before the "
                       r"resume step 6.*it would never run"):
        train(_mixture_recipe(tmp_path, run, 6))


def test_a_chat_file_edited_under_a_run_is_refused(tmp_path):
    import json

    rows = tmp_path / "chat.jsonl"
    convs = [{"messages": [{"role": "user", "content": f"what is {i} plus {i}?"},
                           {"role": "assistant", "content": f"{i} + {i} = {2 * i}."}]}
             for i in range(60)]
    rows.write_text("".join(json.dumps(c) + "\n" for c in convs))
    keep = [o for o in TINY if not o.startswith(("--data.", "--training.seq_len"))]

    def recipe(steps):
        return load_recipe(CONFIGS / "sft_debug.toml", [
            *keep, *DENSE, *ON, f"--data.path={rows}", "--training.seq_len=128",
            f"--data.cache_dir={tmp_path / 'cache'}", f"--training.steps={steps}",
            f"--run.folder={tmp_path / 'run'}"])

    train(recipe(4))
    convs[5]["messages"][1]["content"] = "5 + 5 = 11."  # one answer changed
    rows.write_text("".join(json.dumps(c) + "\n" for c in convs))
    with pytest.raises(CheckpointError, match=r"data changed since this checkpoint"):
        train(recipe(6))

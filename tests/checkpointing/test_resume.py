"""Choosing the checkpoint to resume from, rollbacks, and recipe changes on resume."""

from __future__ import annotations

import re
import shutil

import pytest

from kiln.checkpointing import layout, resume
from kiln.components.errors import CheckpointError
from kiln.recipes.config.diff import diff
from kiln.recipes.config.files import load_recipe, write_recipe
from tests.checkpointing.test_layout import make
from tests.conftest import CONFIGS


def test_auto_off_and_explicit(tmp_path):
    own = tmp_path / "run" / "checkpoints"
    assert resume.resolve("auto", own) is None
    make(own, 1)
    make(own, 2)
    assert resume.resolve("off", own) is None
    src = resume.resolve("auto", own)
    assert src.folder.name == "step_0000002" and not src.explicit
    src = resume.resolve(str(own / "step_0000001"), own)
    assert src.folder.name == "step_0000001" and src.explicit  # a rollback
    # a run folder or a checkpoints folder means its newest checkpoint
    assert resume.resolve(str(tmp_path / "run"), own).folder.name == "step_0000002"


def test_a_foreign_seed_is_used_once_then_the_run_continues_itself(tmp_path):
    other = tmp_path / "other" / "checkpoints"
    make(other, 5)
    own = tmp_path / "run" / "checkpoints"
    src = resume.resolve(str(tmp_path / "other"), own)
    assert src.explicit and src.folder == other / "step_0000005"
    make(own, 2)  # the new run saved its own checkpoint, then was restarted
    src = resume.resolve(str(tmp_path / "other"), own)
    assert not src.explicit and src.folder == own / "step_0000002" and "seeded" in src.note


def test_nothing_to_resume_from_is_an_error(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint.resume = .*does not exist"):
        resume.resolve(str(tmp_path / "missing"), tmp_path / "own")


def test_rollback_moves_newer_checkpoints_aside(tmp_path):
    for s in (1, 2, 3):
        make(tmp_path, s)
    moved = resume.abandon_newer(tmp_path, tmp_path / "step_0000001")
    assert moved == ["step_0000002", "step_0000003"]
    assert layout.newest_complete(tmp_path).name == "step_0000001"
    assert (tmp_path / "abandoned" / "step_0000003").is_dir()
    assert (tmp_path / "latest").read_text().strip() == "step_0000001"
    # the run goes on from step 1 and saves step 2; the same command again continues it
    make(tmp_path, 2)
    src = resume.resolve(str(tmp_path / "step_0000001"), tmp_path)
    assert src.folder.name == "step_0000002" and not src.explicit and "already rolled" in src.note


def recipe(*overrides):
    return load_recipe(CONFIGS / "debug.toml", list(overrides))


def check(saved, current, *, weights_only):
    return resume.check_recipe(diff(saved, current), weights_only=weights_only)


def diff_with(current):
    """What the trainer passes to the checkpoint hook: the checkpoint's recipe vs the current."""
    return lambda folder: diff(load_recipe(folder), current)


def test_allowed_changes_are_reported():
    result = check(recipe(), recipe("--training.steps=999", "--optimizer.lr=1e-4",
                                    "--run.log_interval=3", "--model.init_std=0.01"),
                   weights_only=False)
    assert result.refused == []
    assert any("training.steps" in line for line in result.allowed)
    assert any("optimizer.lr" in line for line in result.allowed)


def test_dropout_and_auxiliary_loss_weights_are_training_settings():
    """They were refused as changing "the weights' shapes or meaning"."""
    moe = ("--model.ffn.type=moe",)
    result = check(recipe(*moe), recipe(*moe, "--model.attention.dropout=0.1",
                                        "--model.ffn.aux_loss_coeff=0.01",
                                        "--model.ffn.bias_update_coeff=0",
                                        "--model.ffn.capacity_factor=1.25"), weights_only=False)
    assert result.refused == [] and len(result.allowed) == 4
    gpt2 = load_recipe(CONFIGS / "gpt2_char.toml")
    result = check(gpt2, load_recipe(CONFIGS / "gpt2_char.toml", ["--model.dropout=0"]),
                   weights_only=False)
    assert result.refused == [] and result.allowed == ["model.dropout: 0.2 -> 0.0"]
    refused = check(recipe(), recipe("--model.mtp_depth=1"), weights_only=False).refused
    assert refused and "shapes" in refused[0]  # the modules themselves still are


def test_an_adapters_shape_or_scale_is_refused_and_its_dropout_is_a_training_setting():
    """A changed rank or adapter type reached DCP's load and its "Missing key in checkpoint
    state_dict: ...lora.A"; alpha resumed on another scale of the saved adapters."""
    lora = ("--adapter.rank=2", "--adapter.allow_random_base=true")
    for change in ("--adapter.rank=4", "--adapter.type=dora", "--adapter.alpha=32",
                   '--adapter.targets=["*.attention.wq"]'):
        for weights_only in (False, True):
            refused = check(recipe(*lora), recipe(*lora, change),
                            weights_only=weights_only).refused
            assert refused and "shapes or meaning" in refused[0], (change, refused)
    result = check(recipe(*lora), recipe(*lora, "--adapter.dropout=0.1"), weights_only=False)
    assert result.refused == [] and result.allowed == ["adapter.dropout: 0.0 -> 0.1"]
    assert check(recipe(), recipe(*lora), weights_only=False).refused  # an adapter added
    assert check(recipe(*lora), recipe(), weights_only=False).refused  # or removed


def test_how_the_data_is_loaded_may_change():
    """Workers, read-ahead and pinned memory leave the cursor's position as it was: fewer
    workers on a smaller machine was refused as "the saved data cursor would point
    elsewhere"."""
    result = check(recipe(), recipe("--data.num_workers=2", "--data.prefetch=4",
                                    "--data.pin_memory=false"), weights_only=False)
    assert result.refused == [] and len(result.allowed) == 3
    mix = load_recipe(CONFIGS / "mixture_debug.toml")
    moved = load_recipe(CONFIGS / "mixture_debug.toml", ["--data.sources.code.num_workers=1"])
    assert check(mix, moved, weights_only=False).refused == []
    assert check(recipe(), recipe("--data.cache_dir=elsewhere"), weights_only=False).refused


def test_where_the_data_lives_may_change_where_a_fingerprint_checks_it():
    moved = diff(recipe(), recipe("--data.cache_dir=/fast", "--data.source_path=/data/py"))
    check_recipe = resume.check_recipe
    assert check_recipe(moved, weights_only=False).refused  # nothing would check it
    result = check_recipe(moved, weights_only=False, fingerprinted=frozenset({"data"}))
    assert result.refused == [] and len(result.allowed) == 2
    other = diff(recipe(), recipe("--data.max_bytes=1000"))  # what the data is: still refused
    assert resume.check_recipe(other, weights_only=False, fingerprinted=frozenset({"data"})
                               ).refused
    mix = load_recipe(CONFIGS / "mixture_debug.toml")
    to = load_recipe(CONFIGS / "mixture_debug.toml", ["--data.sources.code.cache_dir=/fast"])
    assert resume.check_recipe(diff(mix, to), weights_only=False,
                               fingerprinted=frozenset({"data.sources.tests"})).refused
    assert not resume.check_recipe(diff(mix, to), weights_only=False,
                                   fingerprinted=frozenset({"data.sources.code"})).refused


@pytest.mark.parametrize("override, why", [
    ("--model.dim=64", "shapes"),
    ("--model.attention.n_heads=4", "shapes"),
    ("--training.global_batch=16", "data cursor"),
    ("--training.seed=3", "data cursor"),
    ("--optimizer.no_decay.ndim=[1]", "which parameters"),
])
def test_incompatible_changes_are_refused(override, why):
    result = check(recipe(), recipe(override), weights_only=False)
    assert len(result.refused) >= 1 and why in " ".join(result.refused)


def test_optimizer_type_change_is_refused():
    result = check(recipe(), recipe("--optimizer.type=adamw",
                                                  "--optimizer.schedule.type=constant"),
                                 weights_only=False)
    assert result.refused == []  # a schedule change is fine
    assert resume._refusal("optimizer.type", None, False) == "changes the optimizer type"
    assert resume._refusal("optimizers.hidden.type", None, False)
    assert resume._refusal("optimizer.schedule.type", type("D", (), {"only_a": {},
                                                                     "only_b": {}})(), False) == ""


def test_weights_only_allows_data_and_optimizer_changes_but_not_shapes():
    result = check(recipe(), recipe("--training.global_batch=16"),
                                 weights_only=True)
    assert result.refused == []
    result = check(recipe(), recipe("--model.n_layers=2"), weights_only=True)
    assert result.refused


def test_compare_raises_with_instructions(tmp_path):
    write_recipe(recipe(), tmp_path / "recipe.toml")
    with pytest.raises(CheckpointError, match="weights_only = true"):
        resume.compare_with_checkpoint(tmp_path, diff_with(recipe("--model.dim=64")),
                                       weights_only=False, log=print)
    lines = []
    resume.compare_with_checkpoint(tmp_path, diff_with(recipe("--training.steps=7")),
                                   weights_only=False, log=lines.append)
    assert "training.steps: 300 -> 7" in lines[0]


def _resume_table() -> list[tuple[str, str, str]]:
    """(changes, result, notes) rows of docs/checkpointing.md's table of recipe changes on
    resume."""
    lines = (CONFIGS.parent / "docs" / "checkpointing.md").read_text().splitlines()
    start = next(i for i, x in enumerate(lines) if x.startswith("| Change on resume"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(tuple(c.strip() for c in line.strip("|").split(" | ")))
    return rows


def test_docs_table_of_recipe_changes_matches_the_check():
    rows = _resume_table()
    assert {r[1] for r in rows} == {"exact", "documented difference", "refused"}
    checked = 0
    for changes, result, notes in rows:
        name = next((n for n in ("nova_debug.toml", "looped_moe_debug.toml", "gpt2_char.toml")
                     if f"`{n}`" in changes), "debug.toml")
        for override in re.findall(r"`(--[\w.]+=[^`]+)`", changes):
            base = load_recipe(CONFIGS / name, [])
            changed = load_recipe(CONFIGS / name, [override])
            # these recipes' packed data records a fingerprint, as at a real resume
            full = resume.check_recipe(diff(base, changed), weights_only=False,
                                       fingerprinted=frozenset({"data"}))
            assert bool(full.refused) == (result == "refused"), (override, full)
            if "weights_only = true" in notes:
                assert not resume.check_recipe(diff(base, changed),
                                                      weights_only=True).refused
            checked += 1
    assert checked >= 25


def test_starting_over_in_a_copied_run_keeps_its_final_folder(tmp_path):
    """resume = "off" unlinked ``final``: a folder there (a copy that followed the link) raised
    IsADirectoryError. It goes to previous/N with the snapshots."""
    for step in (1, 2):
        folder = tmp_path / layout.step_name(step)
        folder.mkdir()
        (folder / "manifest.json").write_text("{}")
    shutil.copytree(tmp_path / "step_0000002", tmp_path / "final")
    layout.write_atomic(tmp_path / "latest", "step_0000002\n")
    names, dest = resume.set_aside_previous(tmp_path)
    assert names == ["step_0000001", "step_0000002"] and dest == tmp_path / "previous" / "1"
    assert (dest / "final" / "manifest.json").is_file()
    assert not (tmp_path / "final").exists() and not (tmp_path / "latest").exists()

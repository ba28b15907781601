"""The trainer's checkpoint hook: weights-only starts, refused recipe changes, rollbacks, Hub
upload of checkpoints and the final export, and `kiln diff` between two checkpoints."""

from __future__ import annotations

import io
import json

import pytest

from kiln.checkpointing.huggingface import hub
from kiln.components.errors import CheckpointError
from kiln.recipes.cli import main
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.checkpointing.huggingface.test_hub import FolderApi
from tests.checkpointing.test_exact_resume import TINY
from tests.conftest import CONFIGS


def train(folder, *extra):
    recipe = load_recipe(CONFIGS / "debug.toml",
                         [*TINY, "--training.steps=5", "--eval.interval=0",
                          f"--run.folder={folder}", *extra])
    out = io.StringIO()
    trainer = Trainer(recipe, out=out)
    trainer.fit()
    return trainer, out.getvalue()


def test_weights_only_start_skip_and_refused_changes(tmp_path):
    a, _ = train(tmp_path / "a")
    src = tmp_path / "a" / "checkpoints" / "final"
    b, text = train(tmp_path / "b", f"--checkpoint.resume={src}",
                    "--checkpoint.weights_only=true", "--checkpoint.skip_data_steps=2",
                    "--training.global_batch=4")  # allowed for a weights-only start
    assert "started from the weights of" in text and "skipped 2 steps of data" in text
    assert b.progress.step == 5
    # rerunning b continues b's own checkpoint instead of re-seeding from a
    _, text = train(tmp_path / "b", f"--checkpoint.resume={src}",
                    "--checkpoint.weights_only=true", "--training.global_batch=4")
    assert "continuing this run's own checkpoint step_0000005" in text
    with pytest.raises(CheckpointError, match="model.dim"):
        train(tmp_path / "a", "--model.dim=64")
    with pytest.raises(CheckpointError, match="aborted|global_batch"):
        train(tmp_path / "a", "--training.global_batch=4")


def test_rollback_then_continue(tmp_path):
    train(tmp_path / "r", "--checkpoint.interval=2", "--checkpoint.keep_last=0")
    ck = tmp_path / "r" / "checkpoints"
    t, text = train(tmp_path / "r", "--checkpoint.interval=2", "--checkpoint.keep_last=0",
                    f"--checkpoint.resume={ck / 'step_0000002'}")
    assert "rolling back" in text and t.progress.step == 5
    assert sorted(p.name for p in (ck / "abandoned").iterdir()) == ["step_0000004",
                                                                   "step_0000005"]
    assert json.loads((ck / "index.json").read_text())["final"] == "step_0000005"


def test_hub_upload_of_checkpoints_and_export(tmp_path, monkeypatch):
    api = FolderApi(tmp_path / "remote")
    monkeypatch.setattr(hub, "make_api", lambda token_env="HF_TOKEN": api)
    train(tmp_path / "h", "--checkpoint.hub_repo=me/run", "--checkpoint.hub_upload=both",
          "--checkpoint.interval=2", "--checkpoint.hub_keep=1")
    files = api.list_repo_files("me/run")
    assert hub.remote_checkpoints(files) == ["step_0000005"]
    assert {"export/config.json", "export/model.safetensors", "export/recipe.toml"} <= set(files)


def test_kiln_diff_between_two_checkpoints(tmp_path, capsys):
    from tests.checkpointing.huggingface.test_export import checkpoint

    a, _ = checkpoint(tmp_path / "x")
    b, _ = checkpoint(tmp_path / "y", "--optimizer.lr=1e-3")
    assert main(["diff", str(a), str(b)]) == 1
    assert "lr: 0.002 -> 0.001" in capsys.readouterr().out


def test_export_at_end_writes_the_live_model(tmp_path):
    from safetensors.torch import load_file

    trainer, text = train(tmp_path / "e", "--checkpoint.export_at_end=true",
                          "--checkpoint.export_max_shard_size=20KB")
    out = tmp_path / "e" / "export"
    assert f"exported the final model to {out}" in text
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    stored = {k: v for f in set(index["weight_map"].values()) for k, v in
              load_file(out / f).items()}
    assert stored["model.norm.weight"].equal(trainer.model.norm.weight.detach())
    assert (out / "recipe.toml").read_text() == (tmp_path / "e" / "recipe.toml").read_text()


def test_a_crash_right_after_a_snapshot_is_published_loses_no_metrics_line(tmp_path,
                                                                           monkeypatch):
    """The step's metrics line is written before the snapshot holding the step is published
    (before: the checkpoint hook ran first, and a crash between the two lost the line for good,
    since the resume starts after the step)."""
    from kiln.checkpointing import layout

    publish = layout.publish

    class Crash(BaseException):  # like a kill: no handler in kiln catches it
        pass

    def publish_then_crash(tmp, final):
        publish(tmp, final)
        if final.name == "step_0000004":
            raise Crash("injected crash after publishing step 4")

    monkeypatch.setattr(layout, "publish", publish_then_crash)
    with pytest.raises(Crash, match="injected crash"):
        train(tmp_path / "c", "--checkpoint.interval=2", "--eval.interval=2")
    run = tmp_path / "c"
    assert layout.verify(run / "checkpoints" / "step_0000004")["step"] == 4
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if "eval/loss" in r] == [2, 4]
    monkeypatch.setattr(layout, "publish", publish)
    _, text = train(run, "--checkpoint.interval=2", "--eval.interval=2")
    assert "resumed from" in text and "at step 4" in text
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5]  # each step once


def test_a_malformed_loader_cursor_is_refused_before_any_tensor_is_loaded(tmp_path,
                                                                         monkeypatch):
    """A resealed rank file whose loader cursor lacks seq_len. Before: the model and optimizers
    were loaded, then `KeyError: 'seq_len'` from the loader's load_state_dict."""
    from kiln.checkpointing import storage
    from tests.checkpointing.test_manager import edit_rank_header

    train(tmp_path / "m")
    edit_rank_header(tmp_path / "m" / "checkpoints" / "step_0000005",
                     lambda meta: meta["loader"].pop("seq_len"))

    def no_tensors(*args, **kwargs):
        raise AssertionError("tensors were loaded before the cursor was checked")

    monkeypatch.setattr(storage, "load_tensors", no_tensors)
    with pytest.raises(CheckpointError, match=r"rank_00000\.safetensors: data loader cursor: "
                       r"malformed data loader cursor \(seq_len: Field required\)"):
        train(tmp_path / "m", "--training.steps=7")


@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_full_disk_stops_the_run_with_one_error_and_the_rerun_continues(tmp_path, monkeypatch,
                                                                          capsys, async_save):
    """Before: a raw writer error (sync) or DCP's CheckpointException traceback (async)."""
    import errno

    from torch.distributed.checkpoint import FileSystemWriter

    write_data = FileSystemWriter.write_data

    def full_at_step_4(self, plan, planner):
        if "step_0000004" in str(self.path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_data(self, plan, planner)

    monkeypatch.setattr(FileSystemWriter, "write_data", full_at_step_4)
    run = tmp_path / "full"
    args = ["train", str(CONFIGS / "debug.toml"), *TINY, "--training.steps=5",
            "--eval.interval=0", "--checkpoint.interval=2", f"--checkpoint.async={async_save}",
            f"--run.folder={run}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "checkpoint step 4 FAILED (no space left on device: the file system at" in err
    assert "the previous checkpoint step 2 is intact" in err and "Traceback" not in err
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if "step" in p.name) == [
        "step_0000002"]  # the partial save was removed
    monkeypatch.undo()
    assert main(args) == 0
    assert "at step 2" in capsys.readouterr().out

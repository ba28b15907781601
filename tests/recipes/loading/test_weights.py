"""``checkpoint.init_from`` naming a kiln checkpoint or run folder (``weights.Source``): the run
starts from the same weights as from that checkpoint's Hugging Face export, an adapters-only
checkpoint arrives merged, a model that does not match is one clear error, and an adapter run
on a kiln base is refused when that base changes under it."""

from __future__ import annotations

import io
import json

import pytest

from kiln.components.errors import CheckpointError
from kiln.recipes.config.files import load_recipe
from kiln.recipes.inference.saved_model import export_checkpoint
from kiln.recipes.training.trainer import Trainer
from tests.checkpointing.test_exact_resume import Record
from tests.conftest import CONFIGS

TINY = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
        "--model.ffn.hidden_dim=48", "--training.seq_len=32", "--training.global_batch=4",
        "--training.micro_batch=2", "--data.max_bytes=200000", "--run.progress_bar=false",
        "--run.tensorboard=false", "--eval.interval=0", "--eval.at_end=false",
        "--run.log_interval=1", "--checkpoint.interval=2"]


def _run(folder, steps=2, extra=()):
    rec = Record()
    out = io.StringIO()
    recipe = load_recipe(CONFIGS / "debug.toml", [*TINY, f"--training.steps={steps}",
                                                  f"--run.folder={folder}", *extra])
    Trainer(recipe, hooks=[rec], out=out).fit()
    return rec.losses, out.getvalue()


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 2-step run, its checkpoint and that checkpoint's Hugging Face export."""
    root = tmp_path_factory.mktemp("kiln_base")
    _run(root / "run")
    ckpt = root / "run" / "checkpoints" / "step_0000002"
    export_checkpoint(ckpt, root / "hf")
    return root, ckpt


def test_a_checkpoint_a_run_folder_and_the_export_give_the_same_run(base, tmp_path):
    root, ckpt = base
    from_export, _ = _run(tmp_path / "a", extra=[f"--checkpoint.init_from={root / 'hf'}"])
    from_ckpt, log = _run(tmp_path / "b", extra=[f"--checkpoint.init_from={ckpt}"])
    from_run, _ = _run(tmp_path / "c", extra=[f"--checkpoint.init_from={root / 'run'}"])
    assert from_ckpt == from_export == from_run
    assert f"initial weights from {ckpt}" in log
    parent = json.loads((tmp_path / "b" / "parent.json").read_text())
    assert parent["how"] == "init_from" and parent["step"] == 2
    assert parent["checkpoint"] == str(ckpt.resolve())


def test_an_adapters_only_checkpoint_arrives_merged(base, tmp_path):
    root, _ = base
    lora = ["--adapter.rank=2", "--optimizer.lr=3e-2", f"--checkpoint.init_from={root / 'hf'}"]
    _run(tmp_path / "lora", extra=lora)
    ckpt = tmp_path / "lora" / "checkpoints" / "step_0000002"
    export_checkpoint(ckpt, tmp_path / "merged")
    from_merged, _ = _run(tmp_path / "a", extra=[f"--checkpoint.init_from={tmp_path / 'merged'}"])
    from_ckpt, _ = _run(tmp_path / "b", extra=[f"--checkpoint.init_from={ckpt}"])
    assert from_ckpt == from_merged


def test_another_model_is_one_error_naming_the_tensor_and_the_key(base, tmp_path):
    _, ckpt = base
    with pytest.raises(CheckpointError, match=r"tok_embeddings.weight has shape \[\d+, 32\], "
                       r"the recipe's model needs \[\d+, 64\]"):
        _run(tmp_path / "x", extra=[f"--checkpoint.init_from={ckpt}", "--model.dim=64"])
    with pytest.raises(CheckpointError, match="lacks layers.2"):
        _run(tmp_path / "y", extra=[f"--checkpoint.init_from={ckpt}", "--model.n_layers=3"])


def test_a_missing_or_unfinished_source_is_one_line_naming_init_from(tmp_path):
    with pytest.raises(CheckpointError, match="checkpoint.init_from = .*: no such folder; name a "
                       "Hugging Face model folder, hf://OWNER/NAME.*, or a kiln checkpoint"):
        _run(tmp_path / "x", extra=[f"--checkpoint.init_from={tmp_path / 'nowhere'}"])
    (tmp_path / "empty" / "checkpoints" / "step_0000002").mkdir(parents=True)  # never finished
    with pytest.raises(CheckpointError, match="checkpoint.init_from = .*holds no complete "
                       "checkpoint") as err:
        _run(tmp_path / "y", extra=[f"--checkpoint.init_from={tmp_path / 'empty'}"])
    assert "resume" not in str(err.value)


def test_a_run_that_resumes_does_not_need_its_init_from_any_more(base, tmp_path):
    import shutil

    _, ckpt = base
    source = shutil.copytree(ckpt, tmp_path / "source")
    whole, _ = _run(tmp_path / "whole", steps=4, extra=[f"--checkpoint.init_from={source}"])
    _run(tmp_path / "cut", extra=[f"--checkpoint.init_from={source}"])
    shutil.rmtree(source)  # a full fine-tune resumes from its own checkpoint
    rest, _ = _run(tmp_path / "cut", steps=4, extra=[f"--checkpoint.init_from={source}"])
    assert rest == {s: whole[s] for s in (3, 4)}


def test_an_adapter_run_on_a_kiln_run_is_refused_once_that_run_trains_on(tmp_path):
    _run(tmp_path / "base")
    lora = ["--adapter.rank=2", f"--checkpoint.init_from={tmp_path / 'base'}"]
    _run(tmp_path / "lora", extra=lora)
    _run(tmp_path / "lora", steps=4, extra=lora)  # the same base: resumes
    _run(tmp_path / "base", steps=4)  # its newest checkpoint is now another one
    with pytest.raises(CheckpointError, match="trained on other base weights"):
        _run(tmp_path / "lora", steps=6, extra=lora)
    with pytest.raises(CheckpointError, match="trained on other base weights"):
        export_checkpoint(tmp_path / "lora" / "checkpoints" / "step_0000004", tmp_path / "e")

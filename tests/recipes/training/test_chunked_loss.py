"""training.loss_chunk_tokens trains like the unchunked loss, composed with the options that
touch the head or the loss: soft-cap, tied embeddings, bf16, MoE aux loss, looped models with
segmented BPTT, float8 and compile_loss (FSDP2: tests/parallelisms/test_run_train.py)."""

from __future__ import annotations

import os

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.conftest import CONFIGS
from tests.recipes.training.test_trainer import losses

COMMON = [
    "--training.seq_len=32", "--training.global_batch=4", "--training.micro_batch=2",
    "--training.steps=3", "--run.log_interval=1", "--run.progress_bar=false",
    "--run.tensorboard=false", "--eval.interval=0", "--eval.at_end=false",
    "--checkpoint.enable=false",
]
DENSE = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
         "--model.ffn.hidden_dim=64", "--data.max_bytes=300000", "--model.vocab_size=512"]


def _run(tmp_path, recipe, name, extra):
    r = load_recipe(CONFIGS / recipe, [*COMMON, *extra, f"--run.folder={tmp_path / name}"])
    with open(os.devnull, "w") as sink:
        Trainer(r, out=sink).fit()
    return losses(tmp_path / name)


def _compare(tmp_path, recipe, extra, chunk=24):
    plain = _run(tmp_path, recipe, "plain", extra)
    chunked = _run(tmp_path, recipe, "chunked", [*extra, f"--training.loss_chunk_tokens={chunk}"])
    assert len(chunked) == 3
    assert abs(chunked[0] - plain[0]) < 1e-6  # the same weights: the same loss
    # later steps: the gradients are equal to rounding (bf16: to bf16 rounding)
    assert chunked == pytest.approx(plain, rel=2e-5)


@pytest.mark.parametrize("extra", [
    ["--model.logit_softcap=15", "--model.tie_embeddings=true"],
    ["--model.tie_embeddings=false", "--training.mixed_precision=bf16"],
])
def test_dense_chunked_equals_unchunked(tmp_path, extra):
    _compare(tmp_path, "debug.toml", [*DENSE, *extra])


def test_looped_moe_segmented_bptt_chunked_equals_unchunked(tmp_path):
    _compare(tmp_path, "looped_moe_debug.toml", [
        "--model.dim=32", "--model.attention.n_heads=2", "--model.ffn.hidden_dim=32",
        "--model.ffn.aux_loss_coeff=0.01", "--model.logit_softcap=10"])


@pytest.mark.slow
def test_float8_chunked_equals_unchunked(tmp_path):
    _compare(tmp_path, "debug.toml", [*DENSE, "--model.dim=64", "--model.ffn.hidden_dim=128",
                                      "--parallelism.float8=tensorwise",
                                      "--parallelism.float8_min_dim=16"])


@pytest.mark.slow
def test_compile_loss_chunked_equals_unchunked(tmp_path):
    _compare(tmp_path, "debug.toml", [*DENSE, "--parallelism.compile_loss=true"], chunk=32)


def test_model_without_head_argument_is_a_recipe_error(tmp_path, monkeypatch):
    from kiln.components.models import transformer

    monkeypatch.setattr(transformer.Transformer, "forward", lambda self, input_ids: input_ids)
    with pytest.raises(RecipeError, match="training.loss_chunk_tokens"):
        _run(tmp_path, "debug.toml", "x", [*DENSE, "--training.loss_chunk_tokens=8"])

"""Unpacked chat rows (``data.pack = false``: one conversation a row, then padding) run each
micro-batch only as wide as its longest row, rounded up to 16, with the losses of the full
width; where the width must stay (MoE routing, compiled blocks, parallel shares of a row) the
rows keep ``seq_len`` and the start-up log says why."""

from __future__ import annotations

import io
import types

import pytest
import torch

from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.components.protocols import Hook
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training import step_context, trainer
from tests.conftest import CONFIGS
from tests.recipes.test_sft_recipe import TINY

UNPACKED = [*TINY, "--data.pack=false", "--training.steps=3", "--eval.interval=0",
            "--training.seq_len=256",
            "--checkpoint.enable=false"]


class _Losses(Hook):
    def __init__(self):
        self.losses: list[float] = []
        self.computed: list[float | None] = []  # StepResult.flop_tokens: what MFU counts

    def on_step_end(self, trainer, result) -> None:
        self.losses.append(float(result.loss))
        self.computed.append(result.flop_tokens)


def _train(folder, *extra):
    widths: list[int] = []
    out, kept = io.StringIO(), _Losses()
    run = trainer.Trainer(load_recipe(CONFIGS / "sft_debug.toml",
                                      [*UNPACKED, f"--run.folder={folder}", *extra]),
                          hooks=[kept], out=out)
    run.model.register_forward_pre_hook(  # training forwards (not the end's samples)
        lambda m, args: widths.append(args[0].shape[1]) if m.training else None)
    run.fit()
    return kept.losses, widths, out.getvalue(), kept.computed


def test_unpacked_rows_run_as_wide_as_their_longest_with_the_same_losses(tmp_path, monkeypatch):
    losses, widths, log, computed = _train(tmp_path / "cut")
    assert "each micro-batch runs as wide as its longest row" in log
    assert all(w % 16 == 0 and w <= 256 for w in widths) and min(widths) < 256, widths
    assert sum(computed) == sum(2 * w for w in widths)  # micro-batches of 2 rows: MFU's count
    monkeypatch.setattr(trainer, "padding_cut", lambda *a: (0, ""))
    full, full_widths, _, not_cut = _train(tmp_path / "full")
    assert set(full_widths) == {256} and set(not_cut) == {None}  # MFU: the batch's tokens
    assert losses == pytest.approx(full, rel=1e-5)


def test_moe_routing_keeps_the_full_width_and_says_why(tmp_path):
    _, widths, log, _ = _train(tmp_path / "moe", "--model.ffn.type=moe", "--model.ffn.n_experts=2",
                            "--model.ffn.top_k=1", "--model.ffn.hidden_dim=32")
    assert set(widths) == {256}
    assert "padded rows run at training.seq_len: " in log and "counts the batch's tokens" in log


def _model(*overrides):
    recipe = load_recipe(CONFIGS / "debug.toml", ["--model.dim=32", "--model.n_layers=1",
                                                  "--model.attention.n_heads=2", *overrides])
    return recipe.model.build(vocab_size=258, seq_len=32)


@pytest.mark.parametrize("where, expected", [
    ({"tp": object()}, "pipeline, tensor and context parallelism"),
    ({"cp": object()}, "pipeline, tensor and context parallelism"),
    ({"compiled": True}, "is compiled"),
    ({"packed": True}, ""),
])
def test_where_the_width_must_stay(where, expected):
    model = _model()
    if where.get("compiled"):
        model.blocks()[0].compile()
    parallel = types.SimpleNamespace(pipeline=None, tp=where.get("tp"))
    inputs = types.SimpleNamespace(cp=where.get("cp"))
    data = types.SimpleNamespace(padded_rows=not where.get("packed"))
    multiple, line = step_context.padding_cut(model, parallel, inputs, data)
    assert multiple == 0 and expected in line
    if not expected:
        assert line == ""
    whole = step_context.padding_cut(_model(), types.SimpleNamespace(pipeline=None, tp=None),
                                     types.SimpleNamespace(cp=None),
                                     types.SimpleNamespace(padded_rows=True))
    assert whole[0] == step_context.CUT_MULTIPLE


def test_a_cut_keeps_every_label_and_rounds_up():
    labels = torch.full((2, 40), IGNORE_INDEX)
    labels[0, :5], labels[1, 10:17] = 1, 2  # the last label at column 16
    batch = {"input_ids": torch.arange(80).view(2, 40), "labels": labels}
    cut = step_context.without_trailing_padding(batch, 16)
    assert cut["labels"].shape == (2, 32) and torch.equal(cut["labels"], labels[:, :32])
    assert step_context.without_trailing_padding(batch)["labels"].shape == (2, 17)
    none = {"input_ids": batch["input_ids"], "labels": torch.full((2, 40), IGNORE_INDEX)}
    assert step_context.without_trailing_padding(none, 16)["labels"].shape == (2, 40)

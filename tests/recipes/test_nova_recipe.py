"""The Nova recipes: the 10B configuration as the reference has it, its parameter routing, and
the debug recipe (shrunk) training with falling loss and resuming exactly (Muon + 8-bit AdamW
state through kiln's checkpoints)."""

from __future__ import annotations

import io
import os
import signal

import pytest
import torch

from kiln.components.protocols import Hook
from kiln.recipes.config.files import load_recipe
from kiln.recipes.loading.meta_model import build_meta_model
from kiln.recipes.training.optimizer_set import OptimizerSet
from kiln.recipes.training.trainer import Trainer
from tests.conftest import CONFIGS


def test_10b_recipe_is_the_reference_configuration():
    r = load_recipe(CONFIGS / "nova_10b_dense.toml", [])
    m, a = r.model, r.model.attention
    assert (m.dim, m.n_layers, m.vocab_size, r.training.seq_len) == (4096, 35, 65536, 2048)
    assert (a.type, a.n_heads, a.n_kv_heads, a.qk_norm, a.fused_qkv) == (
        "differential", 32, 8, True, True)
    assert (m.ffn.hidden_dim, a.position.theta, m.logit_softcap, m.layerscale_init) == (
        14336, 500000.0, 50.0, 0.1)
    assert m.tie_embeddings and r.parallelism.float8 == "rowwise" and r.parallelism.compile
    opts = r.optimizer_tables()
    assert (opts["muon"].type, opts["muon"].lr, opts["adamw"].type, opts["adamw"].lr) == (
        "muon", 6e-3, "adamw8bit", 2e-4)
    for o in opts.values():
        assert (o.schedule.type, o.schedule.warmup_steps) == ("warmup_cosine", 4000)
    # Issue 10 item 10: the reference trains max(130k, ceil(200e9 / tokens_per_step)) steps.
    from kiln.recipes.preflight import batch_plan

    bp = batch_plan.plan(r.training, world_size=8)
    assert bp.tokens_per_step == 6 * 8 * 8 * 2048
    assert batch_plan.total_steps(r.training, bp, None) == max(130_000, -(-200e9 // 786_432)) \
        == 254_314


def test_10b_parameters_and_routing_on_meta():
    r = load_recipe(CONFIGS / "nova_10b_dense.toml", [])
    model = build_meta_model(r)
    # 35 x (qkv 4096x6144 + o 4096^2 + SwiGLU 3 x 4096x14336) + tied 65536x4096 + small 1-D.
    # The reference calls it "10B"; its own configuration has 7.9B (8.2B counting the head
    # matrix it allocates but leaves unused when tied).
    assert 7.85e9 < model.num_params() < 7.95e9
    opts = OptimizerSet(model, r.optimizer_tables(), total_steps=10)
    muon = opts.routes["muon"]
    assert len(muon.decay) == 35 * 5 and not muon.no_decay  # wqkv, wo, w1, w2, w3 per block
    adamw = opts.routes["adamw"]
    assert [n for n, _ in adamw.decay] == ["tok_embeddings.weight"]  # = the tied head
    assert all(p.ndim == 1 for _, p in adamw.no_decay)
    assert "adamw8bit" in opts.table() and "muon" in opts.table()


TINY = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
        "--model.attention.n_kv_heads=1", "--model.ffn.hidden_dim=64", "--training.seq_len=32",
        "--training.global_batch=4", "--training.micro_batch=2", "--data.max_bytes=300000",
        "--data.eval_fraction=0.2", "--run.log_interval=1", "--run.progress_bar=false",
        "--run.tensorboard=false", "--eval.interval=0", "--eval.at_end=false",
        "--checkpoint.interval=4", "--training.steps=16", "--training.threads=1",
        "--optimizers.muon.schedule.warmup_steps=2", "--optimizers.adamw.schedule.warmup_steps=2"]


class Record(Hook):
    def __init__(self, signal_at: int | None = None):
        self.losses: dict[int, float] = {}
        self.signal_at = signal_at

    def on_step_end(self, trainer, result):
        self.losses[trainer.progress.step] = result.loss
        if trainer.progress.step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # seen after the next step: stops at 4


def _run(folder, signal_at=None):
    recipe = load_recipe(CONFIGS / "nova_debug.toml", [*TINY, f"--run.folder={folder}"])
    rec = Record(signal_at)
    out = io.StringIO()
    trainer = Trainer(recipe, hooks=[rec], out=out)
    trainer.fit()
    return rec, trainer, out.getvalue()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nova")
    return _run(tmp / "full"), _run(tmp / "cut", signal_at=3), _run(tmp / "cut")


@pytest.mark.slow
def test_debug_recipe_trains_with_muon_adamw8bit_and_differential_attention(runs):
    (rec, trainer, out), _, _ = runs
    assert "muon" in out and "adamw8bit" in out  # the routing table is printed
    assert type(trainer.model.blocks()[0].attention).__name__ == "DifferentialAttention"
    kinds = {type(o).__name__ for o in trainer.optimizers.optimizers.values()}
    assert kinds == {"Muon", "AdamW8bit"}
    losses = [rec.losses[s] for s in sorted(rec.losses)]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5  # from ~ln(258) = 5.55 down


@pytest.mark.slow
def test_debug_recipe_resumes_exactly(runs):
    (full, tf, _), (first, t1, _), (second, t2, _) = runs
    assert t1.stop_requested and max(first.losses) == 4 and min(second.losses) == 5
    assert {**first.losses, **second.losses} == full.losses  # bit-identical, every step
    for (k, a), b in zip(tf.model.state_dict().items(), t2.model.state_dict().values(),
                         strict=True):
        assert torch.equal(a, b), k

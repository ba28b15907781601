from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from kiln.parallelisms import ParallelismConfig, materialize, parallelize
from tests.parallelisms.tiny import batches, loss_fn, tiny_model

ONE = SimpleNamespace(world_size=1, device=torch.device("cpu"))


def test_single_process_defaults():
    plan = parallelize(tiny_model(meta=True), ParallelismConfig(), ONE)
    assert plan.summary == "single process"
    assert not plan.fsdp and not plan.replicated and plan.mesh is None


def test_order_and_summary():
    cfg = ParallelismConfig(
        float8="rowwise", compile=True, activation_checkpoint="selective", ac_every=2
    )
    model = tiny_model(meta=True)
    plan = parallelize(model, cfg, ONE)
    assert plan.summary == (
        "float8 rowwise (emulated, inner dimension padded) on 21 Linear layers, compile per "
        "block, "
        "activation checkpointing selective every 2nd block (1 of 3)"
    )
    # float8 first (inside the wrapper), then AC wraps, then compile applies to the wrapper
    block = model.blocks()[1]
    assert isinstance(block, CheckpointWrapper) and block._compiled_call_impl is not None
    assert type(block._checkpoint_wrapped_module.attention.wq).__name__ == "Float8Linear"
    assert "float8 rowwise layers: layers.*.attention.wq x3, layers.*.attention.wk x3" in (
        plan.describe()
    )


def test_replicated_data_parallel_without_fsdp():
    two = SimpleNamespace(world_size=2, device=torch.device("cpu"))
    plan = parallelize(tiny_model(meta=True), ParallelismConfig(fsdp="off"), two)
    assert plan.replicated and not plan.fsdp
    assert plan.summary == "data parallel over 2 ranks (gradient all-reduce)"


def test_fsdp_on_without_process_group_is_noted():
    plan = parallelize(tiny_model(meta=True), ParallelismConfig(fsdp="on"), ONE)
    assert not plan.fsdp and "ignored" in plan.describe()


def test_plan_steps_train_a_meta_built_model():
    model = tiny_model(meta=True)
    plan = parallelize(model, ParallelismConfig(activation_checkpoint="full"), ONE)
    materialize(model, "cpu", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for seqs in batches(0, 4, 4):
        opt.zero_grad()
        with plan.grad_sync(True):
            loss = loss_fn(model, seqs)
            loss.backward()
        plan.sync_grads()
        assert plan.clip_grads(1.0) > 0
        opt.step()
        plan.after_optimizer_step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]

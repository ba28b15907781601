from __future__ import annotations

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kiln.parallelisms.activation_checkpoint import apply_activation_checkpoint
from kiln.parallelisms.config import ParallelismConfig
from tests.parallelisms.tiny import batches, loss_fn, tiny_model

MODES = {
    "full": ParallelismConfig(activation_checkpoint="full"),
    "selective_every_2nd": ParallelismConfig(activation_checkpoint="selective", ac_every=2),
    "selective_ops": ParallelismConfig(activation_checkpoint="selective", ac_ops=True),
}


class LiveActivations(TorchDispatchMode):
    """Records every tensor storage created during forward; ``live_bytes()`` sums those still
    alive afterwards, i.e. what autograd (or a checkpoint) keeps for backward."""

    def __init__(self):
        super().__init__()
        self.refs: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                self.refs.setdefault(s.data_ptr(), (StorageWeakRef(s), s.nbytes()))
        return out

    def live_bytes(self) -> int:
        gc.collect()
        return sum(n for ref, n in self.refs.values() if not ref.expired())


def activation_bytes(model, seqs) -> int:
    probe = LiveActivations()
    with probe:
        loss = loss_fn(model, seqs)
    live = probe.live_bytes()
    del loss
    return live


def loss_and_grads(model, seqs):
    loss = loss_fn(model, seqs)
    loss.backward()
    return loss.detach(), {n.replace("._checkpoint_wrapped_module", ""): p.grad
                           for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", MODES)
def test_same_loss_and_grads_as_none(mode):
    seqs = batches(0, 1, 4)[0]
    ref_loss, ref_grads = loss_and_grads(tiny_model(seed=1), seqs)
    model = tiny_model(seed=1)
    description = apply_activation_checkpoint(model, MODES[mode])
    assert description
    loss, grads = loss_and_grads(model, seqs)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_which_blocks_are_wrapped():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    model = tiny_model(meta=True, n_layers=4)
    text = apply_activation_checkpoint(model, MODES["selective_every_2nd"])
    wrapped = [isinstance(b, CheckpointWrapper) for b in model.blocks()]
    assert wrapped == [False, True, False, True]
    assert text == "activation checkpointing selective every 2nd block (2 of 4)"
    assert apply_activation_checkpoint(model, ParallelismConfig()) == ""


def test_activation_memory_shrinks():
    seqs = batches(0, 1, 8)[0]
    measured = {}
    for mode, cfg in {"none": ParallelismConfig(), **MODES}.items():
        model = tiny_model(seed=1, n_layers=4)
        apply_activation_checkpoint(model, cfg)
        measured[mode] = activation_bytes(model, seqs)
    # full keeps block inputs only; every 2nd block keeps about half; op-level keeps matmuls
    assert measured["full"] < measured["selective_every_2nd"] < measured["none"]
    assert measured["full"] < measured["selective_ops"] < measured["none"]
    assert measured["full"] < 0.5 * measured["none"]

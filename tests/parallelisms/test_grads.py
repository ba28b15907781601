from __future__ import annotations

import copy

import torch
from torch import nn

from kiln.parallelisms.grads import all_reduce_grads, clip_grad_norm, grad_norm, grad_sync_context


def _with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model(torch.randn(5, 8)).pow(2).sum().backward()
    return model


def test_matches_torch_clip():
    ours, ref = _with_grads(), _with_grads()
    norm = clip_grad_norm(ours.parameters(), 0.1)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    torch.testing.assert_close(norm, ref_norm)
    assert norm > 0.1  # clipping was active
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_inf_norm_and_measure_only():
    model = _with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    inf = grad_norm(model.parameters(), float("inf"))
    assert inf == max(g.abs().max() for g in before)
    norm = clip_grad_norm(model.parameters(), 0.0)  # 0 = off: measure only
    assert norm > 0
    for p, g in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, g)


def test_no_grads_gives_zero():
    assert clip_grad_norm(nn.Linear(2, 2).parameters(), 1.0) == 0


def test_single_process_sync_is_a_no_op():
    model = _with_grads()
    before = copy.deepcopy([p.grad for p in model.parameters()])
    with grad_sync_context(model, is_last_microbatch=False):
        pass
    all_reduce_grads(model, world_size=1)
    for p, g in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, g)

"""AdamATan2: the HRM update written out here, scale invariance, EMA + swap, DCP round trip."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.components.base import default_config
from kiln.components.optimizers.adam_atan2 import AdamATan2
from tests.components.optimizers.helpers import dcp_round_trip, make_net, train_steps


def _reference(p, grads, lr, b1, b2, wd):
    """p *= 1 - lr wd; m = lerp(m, g, 1-b1); v = lerp(v, g^2, 1-b2);
    p -= lr/bc1 * atan2(m, sqrt(v)/sqrt(bc2)), one element at a time."""
    p = p.clone()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        p *= 1 - lr * wd
        m = m + (1 - b1) * (g - m)
        v = v + (1 - b2) * (g * g - v)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        p -= lr / bc1 * torch.atan2(m, v.sqrt() / math.sqrt(bc2))
    return p


def test_matches_the_written_out_update():
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(5, 7, generator=gen)
    grads = [torch.randn(5, 7, generator=gen) for _ in range(4)]
    p = torch.nn.Parameter(start.clone())
    opt = AdamATan2([p], lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    torch.testing.assert_close(p.detach(), _reference(start, grads, 0.01, 0.9, 0.95, 0.1))
    assert float(opt.state[p]["step"]) == 4


def test_update_is_bounded_and_gradient_scale_invariant():
    gen = torch.Generator().manual_seed(1)
    g = torch.randn(64, generator=gen)
    moves = []
    for scale in (1e-6, 1.0, 1e6):
        p = torch.nn.Parameter(torch.zeros(64))
        opt = AdamATan2([p], lr=0.1)
        p.grad = g * scale
        opt.step()
        moves.append(p.detach().clone())
    torch.testing.assert_close(moves[0], moves[2])
    torch.testing.assert_close(moves[0], moves[1])
    assert moves[1].abs().max() <= 0.1 * math.pi / 2 + 1e-6  # lr * atan2 bound


def test_parameters_with_different_step_counts():
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    opt = AdamATan2([a, b], lr=0.1, betas=(0.5, 0.5))
    a.grad = torch.ones(3)
    opt.step()  # b has no gradient: it stays, its state is not created
    assert b not in opt.state
    a.grad, b.grad = torch.ones(3), torch.ones(3)
    opt.step()
    torch.testing.assert_close(b.detach(), _reference(torch.ones(3), [torch.ones(3)], 0.1, 0.5,
                                                      0.5, 0.0))
    assert float(opt.state[a]["step"]) == 2 and float(opt.state[b]["step"]) == 1


def test_ema_tracks_weights_and_swaps_in_and_out():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = AdamATan2([p], lr=0.1, ema=0.5)
    history = []
    for i in range(3):
        p.grad = torch.full((4,), 1.0 + i)
        opt.step()
        history.append(p.detach().clone())
    ema = torch.zeros(4)  # starts from the weights before the first step
    for w in history:
        ema = 0.5 * ema + 0.5 * w
    torch.testing.assert_close(opt.state[p]["ema"], ema)
    weights = p.detach().clone()
    assert opt.swap_ema() is True
    torch.testing.assert_close(p.detach(), ema)
    with pytest.raises(RuntimeError, match="swapped in"):
        opt.step()
    assert opt.swap_ema() is False
    torch.testing.assert_close(p.detach(), weights)
    assert "ema" in opt.state_dict()["state"][0]


def test_weights_only_resume_from_ema_trains_on():
    # checkpointing: load, swap_ema(), clear the state, then train a new run from those weights
    p = torch.nn.Parameter(torch.zeros(4))
    opt = AdamATan2([p], lr=0.1, ema=0.5)
    p.grad = torch.ones(4)
    opt.step()
    ema = opt.state[p]["ema"].clone()
    opt.swap_ema()
    opt.state.clear()
    torch.testing.assert_close(p.detach(), ema)
    p.grad = torch.ones(4)
    opt.step()
    assert not opt.ema_swapped and float(opt.state[p]["step"]) == 1


def test_swap_without_ema_is_an_error():
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(RuntimeError, match="no EMA"):
        AdamATan2([p]).swap_ema()


@pytest.mark.parametrize("ema", [0.0, 0.9])
def test_dcp_round_trip_includes_ema(tmp_path, ema):
    cfg = default_config("optimizer", "adam_atan2", lr=1e-2, weight_decay=0.1, ema=ema)

    def make_opt(model):
        return cfg.build([{"params": list(model.parameters()), "lr": cfg.lr, "peak_lr": cfg.lr}])

    assert dcp_round_trip(make_opt, tmp_path) == 0.0


def test_trains_a_small_net():
    model = make_net()
    cfg = default_config("optimizer", "adam_atan2", lr=1e-2)
    opt = cfg.build([{"params": list(model.parameters()), "lr": cfg.lr, "peak_lr": cfg.lr}])
    x = torch.randn(16, 16, generator=torch.Generator().manual_seed(3))
    before = model(x).square().mean().item()
    train_steps(model, opt, 20)
    assert model(x).square().mean().item() < before

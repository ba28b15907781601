"""sgd (torch.optim.SGD) and sign_sgd (lr * sign, decoupled decay, optional momentum)."""

from __future__ import annotations

import pytest
import torch

from kiln.components.base import default_config
from kiln.components.errors import RecipeError
from tests.components.optimizers.helpers import dcp_round_trip


def _build(name: str, params, **values):
    cfg = default_config("optimizer", name, **values)
    return cfg.build([{"params": params, "lr": cfg.lr, "peak_lr": cfg.lr,
                       "weight_decay": cfg.weight_decay}])


def test_sgd_is_torch_sgd():
    p = torch.nn.Parameter(torch.ones(3))
    opt = _build("sgd", [p], lr=0.1, momentum=0.9, nesterov=True)
    assert type(opt) is torch.optim.SGD and opt.param_groups[0]["nesterov"]
    p.grad = torch.tensor([1.0, -2.0, 0.5])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([1 - 0.19, 1 + 0.38, 1 - 0.095]))
    with pytest.raises(RecipeError, match="nesterov = true needs momentum"):
        _build("sgd", [p], nesterov=True)


def test_sign_sgd_moves_every_element_by_lr():
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0]))
    opt = _build("sign_sgd", [p], lr=0.1)
    p.grad = torch.tensor([1e-8, -50.0, 0.0])
    opt.step()
    torch.testing.assert_close(p.detach(), torch.tensor([0.9, 1.1, 1.0]))


def test_sign_sgd_equals_signing_then_torch_sgd_with_decay():
    # The looped-MoE reference: grad.sign_(), then torch.optim.SGD(weight_decay=wd).
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(6, generator=gen)
    grads = [torch.randn(6, generator=gen) for _ in range(3)]
    ours, ref = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opt = _build("sign_sgd", [ours], lr=0.05, weight_decay=0.3)
    ref_opt = torch.optim.SGD([ref], lr=0.05, weight_decay=0.3)
    for g in grads:
        ours.grad, ref.grad = g.clone(), g.sign()
        opt.step()
        ref_opt.step()
    torch.testing.assert_close(ours.detach(), ref.detach())


def test_signum_uses_the_sign_of_the_momentum():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = _build("sign_sgd", [p], lr=1.0, momentum=0.9)
    p.grad = torch.tensor([10.0])
    opt.step()  # buf = 1.0
    p.grad = torch.tensor([-1.0])
    opt.step()  # buf = 0.9 - 0.1 = 0.8 > 0: still moves down
    assert p.item() == -2.0
    assert opt.state[p]["momentum_buffer"].item() == pytest.approx(0.8)


@pytest.mark.parametrize("name, values", [("sgd", {"momentum": 0.9}), ("sign_sgd",
                                                                         {"momentum": 0.5})])
def test_dcp_round_trip(tmp_path, name, values):
    def make_opt(model):
        return _build(name, list(model.parameters()), lr=1e-2, **values)

    assert dcp_round_trip(make_opt, tmp_path) == 0.0

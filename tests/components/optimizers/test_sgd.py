"""sgd (torch.optim.SGD) and sign_sgd (lr * sign, decoupled decay, optional momentum)."""

from __future__ import annotations

import pytest
import torch

from kiln.components.base import default_config
from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe
from tests.components.optimizers.helpers import dcp_round_trip
from tests.conftest import REPO


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


@pytest.mark.parametrize("values", [["--optimizer.momentum=0"],
                                    ["--optimizer.momentum=0.9", "--optimizer.dampening=0.5"]])
def test_sgd_nesterov_is_refused_with_the_recipe(values):
    # torch.optim.SGD's own refusal was a bare ValueError; dampening passed `kiln validate`
    with pytest.raises(RecipeError) as err:
        load_recipe(REPO / "train_configs/debug.toml",
                    ["--optimizer.type=sgd", "--optimizer.nesterov=true", *values])
    assert str(err.value).startswith("command line: [optimizer]: nesterov = true needs momentum "
                                     "> 0 and dampening = 0")


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


def _looped_with_lambda(init: float):
    from kiln.components.optimizers.common import ParamRule
    from kiln.recipes.training.optimizer_set import OptimizerSet

    c = default_config("model", "looped", dim=16, loops=2, loop_scale="learned",
                       loop_scale_init=init, loop_scale_max=1.0,
                       attention=default_config("attention", "causal", n_heads=2))
    model = c.build(vocab_size=20, seq_len=8)

    def opts(**values):
        tables = {
            "main": default_config("optimizer", "adamw", params=ParamRule(rest=True)),
            "lam": default_config("optimizer", "sign_sgd", lr=1e-3, weight_decay=0.1, no_decay=[],
                                  params=ParamRule(include=["loop_scale_raw"]), **values),
        }
        return OptimizerSet(model, tables, total_steps=10).optimizers["lam"]

    return model, opts


@pytest.mark.parametrize("init", [0.5, 0.9])
def test_sign_sgd_moves_the_loop_scale_itself_by_lr(init):
    """Issue 10 item 4: the reference compensates the Jacobian of lambda = max * sigmoid(raw)
    (raw.grad <- sign(g) / jac, then SGD), so lambda moves by lr; kiln moved raw by lr."""
    model, opts = _looped_with_lambda(init)
    raw = model.loop_scale_raw
    start = raw.detach().clone()
    sig = torch.sigmoid(start)
    jac = sig * (1 - sig)
    for value_space, moved in ((True, 1e-3), (False, 1e-3 * float(jac))):
        with torch.no_grad():
            raw.copy_(start)
        before = model.loop_scale().item()
        opt = opts(value_space=value_space)
        raw.grad = torch.tensor([-2.5])  # lambda should grow
        opt.step()
        grown = model.loop_scale().item() - before
        decay = 1e-3 * 0.1 * float(start) * float(jac)  # decoupled decay on raw, in lambda
        assert grown == pytest.approx(moved - decay, rel=1e-2), value_space  # first order
    # exactly the reference's update: raw.grad = sign(g) / jac, then SGD with L2 decay
    ref = torch.nn.Parameter(start.clone())
    ref.grad = torch.tensor([-2.5]).sign() / jac.clamp_min(1e-4)
    torch.optim.SGD([ref], lr=1e-3, weight_decay=0.1).step()
    with torch.no_grad():
        raw.copy_(start)
    opt = opts()
    raw.grad = torch.tensor([-2.5])
    opt.step()
    torch.testing.assert_close(raw.detach(), ref.detach())

"""Muon: batched NS equals torch's, the optimizer equals torch.optim.Muon, expert stacks,
shape errors by name, DCP round trip; FSDP2 equals single-process (slow, 2 processes)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from kiln.components.base import default_config
from kiln.components.errors import RecipeError
from kiln.components.optimizers.muon import Muon
from kiln.components.optimizers.orthogonalize import (
    NS_COEFFICIENTS,
    chunk_rows,
    lr_scale,
    newton_schulz,
    resolve_ns_dtype,
)
from kiln.components.optimizers.routing import param_groups, route
from tests import nova_dist
from tests.components.optimizers.helpers import dcp_round_trip, make_net, train_steps


def _matrices(model):
    return [p for p in model.parameters() if p.ndim == 2]


@pytest.mark.parametrize("shape", [(6, 16, 8), (3, 8, 20), (2, 12, 12)])
def test_batched_newton_schulz_is_bitwise_torch(shape):
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz(g)
    ref = torch.stack([torch_ns(m, NS_COEFFICIENTS, 5, 1e-7) for m in g])
    assert torch.equal(ours, ref)
    assert torch.equal(newton_schulz(g[0]), ref[0])  # a single 2-D matrix too


def test_newton_schulz_roughly_orthogonalises():
    g = torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    s = torch.linalg.svdvals(newton_schulz(g).float())
    assert s.min() > 0.6 and s.max() < 1.3  # singular values pushed towards 1 (~U(0.7, 1.2))


def test_ns_dtype_auto_is_fp32_on_cpu_and_bf16_elsewhere():
    assert resolve_ns_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_ns_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_ns_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert resolve_ns_dtype("float32", torch.device("cuda")) == torch.float32
    g = torch.randn(8, 12, generator=torch.Generator().manual_seed(0))
    assert newton_schulz(g, dtype=torch.float32).dtype == torch.float32


def test_the_step_runs_newton_schulz_in_ns_dtype():
    """auto on CPU is the fp32 step; bfloat16 is torch.optim.Muon's, a different rounding."""
    gen = torch.Generator().manual_seed(0)
    grad, start = torch.randn(8, 12, generator=gen), torch.randn(8, 12, generator=gen)
    after = {}
    for setting in ("auto", "float32", "bfloat16"):
        p = torch.nn.Parameter(start.clone())
        p.grad = grad.clone()
        Muon([p], lr=0.1, ns_dtype=setting).step()
        after[setting] = p.detach()
    assert torch.equal(after["auto"], after["float32"])
    assert not torch.equal(after["auto"], after["bfloat16"])
    # bf16's rounding: about 1e-2 of the unit-scale update
    torch.testing.assert_close(after["auto"], after["bfloat16"], atol=0.1 * 0.05, rtol=0)


def test_lr_scale_rules():
    assert lr_scale("original", 64, 16) == 2.0
    assert lr_scale("original", 16, 64) == 1.0
    assert lr_scale("match_rms_adamw", 16, 64) == pytest.approx(0.2 * 8)
    assert chunk_rows(10, 4) == [3, 3, 3, 1] and chunk_rows(2, 4) == [1, 1, 0, 0]


@pytest.mark.parametrize("rule", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_equals_torch_muon(rule, nesterov):
    ours, ref = make_net(), make_net()
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    opt = Muon(_matrices(ours), lr_scaling=rule, ns_dtype="bfloat16", **kw)  # torch's
    opt_ref = torch.optim.Muon(_matrices(ref), adjust_lr_fn=rule, **kw)
    for m in (ours, ref):  # only the matrices train
        for p in m.parameters():
            p.requires_grad_(p.ndim == 2)
    train_steps(ours, opt, 3)
    train_steps(ref, opt_ref, 3)
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q)
    assert set(opt.state_dict()["state"][0]) == set(opt_ref.state_dict()["state"][0])


def test_expert_stack_is_orthogonalised_per_expert():
    gen = torch.Generator().manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(3, 8, 12, generator=gen))
    singles = [torch.nn.Parameter(stack[e].detach().clone()) for e in range(3)]
    opt = Muon([stack], lr=0.1, expert_stacks=True, lr_scaling="match_rms_adamw")
    opt_ref = Muon(singles, lr=0.1, lr_scaling="match_rms_adamw")
    for _ in range(2):
        g = torch.randn(3, 8, 12, generator=gen)
        stack.grad = g.clone()
        for e, p in enumerate(singles):
            p.grad = g[e].clone()
        opt.step()
        opt_ref.step()
    torch.testing.assert_close(stack.detach(), torch.stack([p.detach() for p in singles]),
                               atol=0, rtol=0)


def test_non_matrices_are_named_at_build():
    model = make_net()
    cfg = default_config("optimizer", "muon")
    groups = [{"params": [model.b.bias, model.a.weight], "name": "muon"}]
    with pytest.raises(RecipeError, match=r"muon\[0\] \(24,\)"):
        cfg.build(groups)
    with pytest.raises(RecipeError, match="set expert_stacks = true"):
        cfg.build([{"params": [torch.nn.Parameter(torch.zeros(2, 3, 4))]}])
    stacks = default_config("optimizer", "muon", expert_stacks=True)
    stacks.build([{"params": [torch.nn.Parameter(torch.zeros(2, 3, 4)), model.a.weight]}])


def test_build_from_routing():
    model = make_net()
    tables = {"muon": default_config("optimizer", "muon", lr=0.01),
              "rest": default_config("optimizer", "adamw")}
    routes = route(model, tables)
    opt = tables["muon"].build(param_groups(routes["muon"], tables["muon"]))
    assert isinstance(opt, Muon)
    assert [len(g["params"]) for g in opt.param_groups] == [4]  # a, b, c, d weights


def test_lr_from_the_group_is_used():
    # The trainer writes group["lr"] = peak_lr * schedule(step); the update must follow it.
    p = torch.nn.Parameter(torch.zeros(4, 4))
    opt = Muon([{"params": [p], "peak_lr": 0.5, "lr": 0.5}])
    opt.param_groups[0]["lr"] = 0.25
    p.grad = torch.eye(4)
    opt.step()
    # NS(I) ~ I scaled so its spectrum is ~1; the step is lr * that (original scale 1 here).
    assert p.detach().diagonal().mean().item() == pytest.approx(-0.25 * newton_schulz(
        torch.eye(4), dtype=torch.float32).diagonal().mean().item(), rel=1e-6)
    assert math.isclose(opt.param_groups[0]["peak_lr"], 0.5)


def test_dcp_round_trip(tmp_path):
    cfg = default_config("optimizer", "muon", lr=0.02, weight_decay=0.1)

    def make_opt(model):
        for p in model.parameters():
            p.requires_grad_(p.ndim == 2)
        return cfg.build([{"params": _matrices(model), "lr": cfg.lr, "peak_lr": cfg.lr}])

    assert dcp_round_trip(make_opt, tmp_path) == 0.0


@pytest.mark.slow
def test_fsdp2_equals_single_process():
    res = nova_dist.results()["muon"]
    assert res["owner_vs_single"] == 0.0  # bitwise: same full matrices, same batched NS
    assert res["dcp_round_trip"] == 0.0
    assert res["other_layouts_vs_single"] == 0.0  # replicated, column-sharded, expert stacks

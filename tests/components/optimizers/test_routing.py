"""Parameter routing: every trainable parameter in exactly one optimizer, reported by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.components.base import default_config
from kiln.components.errors import RecipeError
from kiln.components.optimizers.common import ParamRule
from kiln.components.optimizers.routing import param_groups, route, routing_table


class Tiny(nn.Module):
    def __init__(self, tie: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(16, 8)
        self.wq = nn.Linear(8, 8, bias=True)
        self.norm = nn.LayerNorm(8)
        self.scale = nn.Parameter(torch.ones(8))
        self.output = nn.Linear(8, 16, bias=False)
        if tie:
            self.output.weight = self.tok_embeddings.weight


class MyLinear(nn.Linear):  # stands in for Float8Linear / FSDPLinear subclasses
    pass


def nova_tables(lr_muon: float = 6e-3, lr_adam: float = 2e-4) -> dict:
    """The Nova rule: 2-D weights but embeddings and head -> muon; the rest -> adamw8bit;
    1-D parameters (norms, biases, scales) without weight decay."""
    return {
        "muon": default_config("optimizer", "muon", lr=lr_muon, weight_decay=0.1, params=ParamRule(
            ndim=[2], exclude=["output.*"], exclude_modules=["Embedding"])),
        "adamw": default_config("optimizer", "adamw8bit", lr=lr_adam, weight_decay=0.1,
                                params=ParamRule(rest=True), no_decay=ParamRule(ndim=[1])),
    }


def _names(members):
    return sorted(n for n, _ in members)


def test_nova_rule_routes_matrices_to_muon_and_the_rest_to_adamw():
    routes = route(Tiny(), nova_tables())
    assert _names(routes["muon"].decay) == ["wq.weight"]
    assert routes["muon"].no_decay == []
    assert _names(routes["adamw"].decay) == ["output.weight", "tok_embeddings.weight"]
    assert _names(routes["adamw"].no_decay) == ["norm.bias", "norm.weight", "scale", "wq.bias"]


def test_tied_matrix_is_routed_once():
    routes = route(Tiny(tie=True), nova_tables())
    assert _names(routes["adamw"].decay) == ["tok_embeddings.weight"]
    total = sum(len(r.decay) + len(r.no_decay) for r in routes.values())
    assert total == len(list(Tiny(tie=True).parameters()))


def test_module_rules_match_subclasses():
    model = Tiny()
    model.wq = MyLinear(8, 8)
    tables = {
        "a": default_config("optimizer", "adamw", params=ParamRule(modules=["Linear"], ndim=[2])),
        "b": default_config("optimizer", "adamw", params=ParamRule(rest=True)),
    }
    routes = route(model, tables)
    assert _names(routes["a"].decay) == ["output.weight", "wq.weight"]


def test_unrouted_parameters_are_named():
    tables = {"m": default_config("optimizer", "muon", params=ParamRule(ndim=[2]))}
    with pytest.raises(RecipeError, match="routed to no optimizer") as err:
        route(Tiny(), tables)
    for name in ("wq.bias", "norm.weight", "scale"):
        assert name in str(err.value)


def test_doubly_routed_parameters_are_named():
    tables = {
        "a": default_config("optimizer", "adamw", params=ParamRule(ndim=[2])),
        "b": default_config("optimizer", "adamw", params=ParamRule(include=["wq.*"])),
        "c": default_config("optimizer", "adamw", params=ParamRule(rest=True)),
    }
    with pytest.raises(RecipeError, match="more than one optimizer") as err:
        route(Tiny(), tables)
    assert "wq.weight: a, b" in str(err.value)


def test_two_rest_tables_are_rejected():
    tables = {n: default_config("optimizer", "adamw") for n in ("a", "b")}
    with pytest.raises(RecipeError, match="only one may take the rest"):
        route(Tiny(), tables)


def test_frozen_parameters_are_not_routed():
    model = Tiny()
    model.scale.requires_grad_(False)
    routes = route(model, nova_tables())
    assert "scale" not in _names(routes["adamw"].no_decay)


def test_param_groups_carry_peak_lr_names_and_decay():
    tables = nova_tables()
    routes = route(Tiny(), tables)
    groups = param_groups(routes["adamw"], tables["adamw"])
    assert [g["name"] for g in groups] == ["adamw", "adamw/no_decay"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert all(g["lr"] == g["peak_lr"] == 2e-4 for g in groups)
    assert {id(p) for p in groups[1]["params"]} == {id(p) for _, p in routes["adamw"].no_decay}


def test_muon_rejects_non_matrices_by_name():
    tables = {
        "muon": default_config("optimizer", "muon", params=ParamRule(exclude=["output.*"])),
        "adamw": default_config("optimizer", "adamw"),
    }
    with pytest.raises(RecipeError, match=r"\[optimizers.muon\] \(muon\) trains 2-D") as err:
        route(Tiny(), tables)
    assert "wq.bias (8,)" in str(err.value) and "norm.weight (8,)" in str(err.value)
    assert "wq.weight" not in str(err.value)


def test_routing_table_lists_counts_and_sizes():
    tables = nova_tables()
    text = routing_table(route(Tiny(), tables), tables)
    lines = text.splitlines()
    assert lines[0].split()[:5] == ["optimizer", "type", "tensors", "params", "peak_lr"]
    muon = next(line for line in lines if line.startswith("muon"))
    assert muon.split()[:5] == ["muon", "muon", "1", "64", "0.006"]
    adamw = next(line for line in lines if line.startswith("adamw"))
    # 16*8 + 16*8 embedding/head + 8 + 8 + 8 + 8 norms, bias, scale = 288 elements
    assert adamw.split()[:6] == ["adamw", "adamw8bit", "6", "288", "0.0002", "2/4"]


def test_by_default_norms_biases_and_embeddings_are_not_decayed():
    routes = route(Tiny(), {"main": default_config("optimizer", "adamw")})
    assert _names(routes["main"].no_decay) == [
        "norm.bias", "norm.weight", "scale", "tok_embeddings.weight", "wq.bias"]
    assert _names(routes["main"].decay) == ["output.weight", "wq.weight"]
    tied = route(Tiny(tie=True), {"main": default_config("optimizer", "adamw")})
    assert "tok_embeddings.weight" in _names(tied["main"].no_decay)  # the tied head too


def test_an_empty_no_decay_list_decays_everything_and_one_table_is_a_list():
    everything = default_config("optimizer", "adamw", no_decay=[])
    assert route(Tiny(), {"main": everything})["main"].no_decay == []
    one = default_config("optimizer", "adamw", no_decay={"ndim": [1]})
    assert one.no_decay == [ParamRule(ndim=[1])]

"""Collectives go through ``kiln.components.distributed``, which hands each one its tensor on the
process group's device (NCCL takes CUDA tensors only) and copies the result back. The 2-process
gloo check of every collective a real run makes is in
tests/recipes/test_combinations_distributed.py."""

from __future__ import annotations

import ast
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from kiln.components import distributed
from tests.collective_spy import COLLECTIVES
from tests.conftest import REPO


class _Stop(Exception):
    """Raised by a fake collective once it has seen its tensor (a meta tensor holds no data)."""


@pytest.fixture
def fake_group(monkeypatch):
    """A process group whose collectives take tensors on ``meta``: records what they get."""
    seen: list[tuple[str, torch.device]] = []
    monkeypatch.setattr(distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed, "group_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def fake(name):
        def collective(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a
                        if isinstance(t, torch.Tensor)]
            seen.extend((name, t.device) for t in tensors)
            raise _Stop

        return collective

    for name in ("all_reduce", "broadcast", "all_gather", "all_to_all_single",
                 "reduce_scatter_single", "reduce_scatter_tensor"):
        if hasattr(dist, name):
            monkeypatch.setattr(dist, name, fake(name))
    return seen


@pytest.mark.parametrize("call", [
    lambda: distributed.all_reduce_(torch.ones(3), "max"),
    lambda: distributed.broadcast_(torch.ones(3)),
    lambda: distributed.all_gather(torch.ones(3)),
    lambda: distributed.all_to_all_single_(torch.empty(4), torch.ones(4), [2, 2], [2, 2]),
    lambda: distributed.reduce_scatter_(torch.empty(2), torch.ones(4)),
], ids=["all_reduce_", "broadcast_", "all_gather", "all_to_all_single_", "reduce_scatter_"])
def test_helpers_hand_the_collective_tensors_on_the_group_device(fake_group, call):
    with pytest.raises(_Stop):
        call()
    assert fake_group and all(dev == torch.device("meta") for _, dev in fake_group), fake_group


def test_group_device_follows_the_backend(monkeypatch):
    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 1)
    for backend, want in (("nccl", torch.device("cuda", 1)), ("gloo", torch.device("cpu")),
                          ("cpu:gloo,cuda:nccl", torch.device("cuda", 1)),
                          ("xccl", torch.device("xpu", 1)),
                          ("cpu:gloo,xpu:xccl", torch.device("xpu", 1))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert distributed.group_device() == want, backend


def test_helpers_are_the_identity_in_one_process():
    t = torch.arange(4.0)[::2]  # a non-contiguous view stays the caller's tensor
    assert distributed.all_reduce_(t) is t and distributed.broadcast_(t) is t
    assert distributed.all_gather(t)[0] is t
    out = torch.empty(4)
    distributed.all_to_all_single_(out, torch.arange(4.0), [4], [4])
    assert out.tolist() == [0, 1, 2, 3]
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}
    assert distributed.all_gather_object("host") == ["host"]
    out = torch.empty(2)
    distributed.reduce_scatter_(out, torch.tensor([[1.0, 2.0]]))
    assert out.tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match="avg"):
        distributed.all_reduce_(t, "avg")


def test_in_place_helpers_copy_results_back(monkeypatch):
    """A tensor staged on another device (or made contiguous) gets the reduced values back."""
    monkeypatch.setattr(distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(distributed, "group_device", lambda group=None: torch.device("cpu"))
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None, group=None: t.mul_(2))
    base = torch.arange(6.0)
    view = base[::2]  # non-contiguous: staged as a contiguous copy
    distributed.all_reduce_(view)
    assert base.tolist() == [0, 1, 4, 3, 8, 5]


def test_checkpoint_verify_shares_its_verdict_on_the_group_device(fake_group, tmp_path,
                                                                  monkeypatch):
    """Item 2 of issue 10: the load-time verify all-reduced a CPU tensor (NCCL rejects it). Now
    rank 0's verdict (the error text) goes to every rank through ``broadcast_object``."""
    from kiln.checkpointing.manager import CheckpointManager

    sent = []

    def broadcast_object_list(objs, src=0, group=None, device=None):
        sent.append((list(objs), device))

    monkeypatch.setattr(dist, "broadcast_object_list", broadcast_object_list)
    world = SimpleNamespace(rank=0, world_size=2, is_main=True, distributed=True,
                            device=torch.device("cpu"))
    manager = CheckpointManager(tmp_path, world)
    assert "missing" in manager.verify(tmp_path / "missing")  # rank 0 finds it invalid
    [(objs, device)] = sent
    assert device == torch.device("meta") and "missing" in objs[0]


def _direct_collectives(path) -> list[str]:
    """Calls of torch.distributed collectives in one source file, however the module is named."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = {"torch.distributed"}
    direct: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname for a in node.names if a.name == "torch.distributed" and a.asname}
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch.distributed", "torch"):
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    aliases.add(a.asname or a.name)
                elif node.module == "torch.distributed" and a.name in COLLECTIVES:
                    direct.add(a.asname or a.name)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id in direct:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {fn.id}")
        elif isinstance(fn, ast.Attribute) and fn.attr in COLLECTIVES \
                and ast.unparse(fn.value) in aliases:
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(fn)}")
    return found


def test_no_module_calls_collectives_around_the_helpers():
    helpers = REPO / "components" / "distributed.py"
    files = [p for top in ("components", "parallelisms", "checkpointing", "recipes")
             for p in (REPO / top).rglob("*.py") if p != helpers]
    assert len(files) > 50
    found = [hit for p in files for hit in _direct_collectives(p)]
    assert not found, "call kiln.components.distributed instead:\n" + "\n".join(found)
    assert _direct_collectives(helpers)  # the scan does see calls where they are

"""Expert parallelism for ``ffn.moe`` (``parallelism.ep``): the experts of every MoE layer are
split over ``ep`` data-parallel ranks, whole experts per rank.

Each rank routes its own tokens with the replicated router and sends every routed row to the rank
holding its expert (``kiln.components.ffn.moe_all_to_all``). The stacked expert weights
``w1``/``w3``/``w2`` (E, ., .) become DTensors ``Shard(0)`` over the mesh's ``ep`` dimension:
DCP saves them as the full stacks, Muon orthogonalises each local expert whole, and the gradient
norm counts every expert once.

Gradients: the all-to-all backward already sums, on the rank holding an expert, what every rank of
its ``ep`` group sent to it. The ranks holding the same experts (``ep_replicate``: the other data-
parallel groups and the tensor-parallel peers, whose sequence slices are disjoint tokens) then sum
theirs in one all-reduce, divided by the data-parallel size — the mean over the global batch, as
one process computes it. FSDP2 leaves the expert weights alone (``ignored_params``): ep is their
sharding. Routers, shared experts and the rest of the block follow the data-parallel plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kiln.components import distributed
from kiln.components.ffn.moe import moe_layers

EXPERT_WEIGHTS = ("w1", "w3", "w2")


@dataclass
class ExpertParallel:
    """What the plan did, and the per-step gradient sum of the expert weights."""

    mesh: DeviceMesh  # ("ep_replicate", "ep")
    dp_size: int
    params: list[nn.Parameter] = field(default_factory=list)

    @property
    def size(self) -> int:
        return self.mesh["ep"].size()

    def describe(self) -> str:
        return f"expert parallel {self.size} (all-to-all dispatch)"

    @torch.no_grad()
    def sync_grads(self) -> None:
        """After the last backward: sum the expert gradients over the ranks holding the same
        experts and divide by the data-parallel size (one all-reduce)."""
        grads = [p.grad.to_local() for p in self.params if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.mesh["ep_replicate"].size() > 1:
            distributed.all_reduce_(flat, group=self.mesh["ep_replicate"].get_group())
        flat.div_(self.dp_size)
        for g, s in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            g.copy_(s.view_as(g))


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, dp_size: int) -> ExpertParallel:
    """Shard every MoE layer's expert stacks over ``mesh["ep"]`` in place (meta or real)."""
    ep_mesh = mesh["ep"]
    plan = ExpertParallel(mesh=mesh, dp_size=dp_size)
    for layer in moe_layers(model):
        for name in EXPERT_WEIGHTS:
            p = getattr(layer, name)
            sharded = nn.Parameter(
                distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None),
                requires_grad=p.requires_grad,
            )
            setattr(layer, name, sharded)
            plan.params.append(sharded)
        layer.expert_group, layer.ep = ep_mesh.get_group(), ep_mesh.size()
    return plan


def expert_params(model: nn.Module) -> set[nn.Parameter]:
    """The expert-parallel DTensor weights of ``model`` (those FSDP2 must leave alone)."""
    return {getattr(m, n) for m in moe_layers(model) for n in EXPERT_WEIGHTS
            if m.ep > 1 and isinstance(getattr(m, n), DTensor)}

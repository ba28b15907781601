"""Tensor parallelism with sequence parallelism: Megatron-LM's plan, on DTensor (as torchtitan).

Between blocks the residual stream is this rank's slice of the sequence, a plain (B, T/tp, dim)
tensor. In every block:

- ``attention_norm`` / ``ffn_norm``: sequence parallel (``SequenceParallel``: the norm runs on the
  slice; its weight is a replicated DTensor whose gradient DTensor sums over the ranks);
- attention: the input is all-gathered over the sequence, ``wq``/``wk``/``wv`` (or the kv-grouped
  ``wqkv``) are split column-wise, so a rank computes whole heads (GQA groups stay together; both
  maps of a differential head stay on one rank), and ``wo`` row-wise, reduce-scattered back to
  sequence slices;
- feed-forward: SwiGLU the same way (``w1``/``w3`` column-wise, ``w2`` row-wise), a two-layer
  MLP too (``w1`` column-wise, ``w2`` row-wise); an MoE layer
  gets no plan: each rank routes its own sequence slice (``ffn.moe`` sees local tokens).

Model level: ``tok_embeddings`` row-wise (vocabulary shards; the output leaves as sequence
slices), the final norm (and the looped model's ``state_norm``) sequence parallel, ``output``
column-wise (vocabulary shards; with ``loss_parallel`` the logits stay sharded and the
cross-entropy runs on the shards). A tied embedding/head matrix is one ``Shard(0)`` DTensor.

Parameters no plan covers (LayerScale, QK-norm and differential head-norm weights, differential
lambdas and head gates, the looped core's adapter and loop scale, MoE routers and experts) stay
whole on every tensor-parallel rank, but a rank computes only its share of the work that uses
them (its sequence slice or its heads), so their gradients are partial sums:
``TensorParallel.sync_grads`` sums them over the tp group after backward (one all-reduce).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from kiln.components import distributed
from kiln.components.errors import KilnError, RecipeError
from kiln.parallelisms.blocks import clean_name, model_blocks

ATTENTION_LINEARS = (("wq", "wk", "wv"), ("wqkv",))
SWIGLU_LINEARS = ("w1", "w3", "w2")
MLP_LINEARS = ("w1", "w2")  # a two-layer MLP (GPT-2): up column-wise, down row-wise


@dataclass
class TensorParallel:
    """What the plan did, and the per-step gradient sum of the parameters it left whole."""

    mesh: DeviceMesh
    loss_parallel: bool
    partial_params: list[str] = field(default_factory=list)
    float8_styles: bool = False

    @property
    def size(self) -> int:
        return self.mesh.size()

    def describe(self) -> str:
        text = f"tensor parallel {self.size} (sequence-parallel norms"
        text += ", loss parallel" if self.loss_parallel else ""
        text += ", float8 all-gather" if self.float8_styles else ""
        return text + ")"

    @torch.no_grad()
    def sync_grads(self, model: nn.Module) -> None:
        """After backward: sum the partial gradients over the tp ranks, in one all-reduce — those
        of the whole (unplanned) parameters, and DTensor gradients that DTensor left ``Partial``
        (replicated weights such as the sequence-parallel norms'); then give every DTensor
        gradient its parameter's placements (the embedding's comes back replicated)."""
        wanted = set(self.partial_params)
        locals_: list[torch.Tensor] = []
        rebuild: list[tuple[nn.Parameter, DTensor, int]] = []
        for name, p in model.named_parameters():
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                if g.device_mesh != self.mesh:
                    raise RuntimeError(f"{name}: partial gradient on an unexpected mesh "
                                       f"{g.device_mesh} (tensor parallel expects {self.mesh})")
                rebuild.append((p, g, len(locals_)))
                locals_.append(g.to_local())
            elif isinstance(g, DTensor) and g.placements != p.placements:
                p.grad = g.redistribute(placements=p.placements)
            elif clean_name(name) in wanted:
                locals_.append(g.to_local() if isinstance(g, DTensor) else g)
        if not locals_:
            return
        flat = torch.cat([g.reshape(-1) for g in locals_])
        distributed.all_reduce_(flat, group=self.mesh.get_group())
        summed = flat.split([g.numel() for g in locals_])
        for g, s in zip(locals_, summed, strict=True):
            g.copy_(s.view_as(g))
        for p, g, i in rebuild:
            placements = [Replicate() if pl.is_partial() else pl for pl in g.placements]
            full = DTensor.from_local(locals_[i], g.device_mesh, placements, run_check=False)
            p.grad = full.redistribute(placements=p.placements)


_loss_parallel_depth = 0


@contextlib.contextmanager
def loss_parallel_context(enabled: bool) -> Iterator[None]:
    """``torch``'s ``loss_parallel()``, re-entrant (the trainer enters it around forward and
    backward, and again around the loss itself, for evaluation)."""
    global _loss_parallel_depth
    if not enabled or _loss_parallel_depth:
        _loss_parallel_depth += enabled
        try:
            yield
        finally:
            _loss_parallel_depth -= enabled
        return
    _loss_parallel_depth += 1
    try:
        with loss_parallel():
            yield
    finally:
        _loss_parallel_depth -= 1


def _check_float8_backend(mesh: DeviceMesh) -> None:
    """torchao's float8 tensor-parallel styles all-gather float8 tensors; gloo cannot send them
    (``RuntimeError: Invalid scalar type`` in the first forward, measured on torch 2.13)."""
    import torch.distributed as dist

    if dist.get_backend(mesh.get_group()) == "gloo":
        raise KilnError(
            "parallelism.float8 = \"tensorwise\" with parallelism.tp > 1 all-gathers float8 "
            "activations between the tensor-parallel ranks (torchao's Float8ColwiseParallel), "
            "which the gloo backend (CPU) cannot send; use parallelism.float8 = \"rowwise\" "
            "(its tensor-parallel all-gathers stay in high precision) or train on CUDA (nccl)"
        )


class _Waited(torch.autograd.Function):
    """Identity that waits for a functional collective's result (an ``AsyncCollectiveTensor``)
    and hands on a plain tensor, keeping the autograd edge: handed across a ``torch.compile``
    boundary unwaited, AOT autograd expects an ``AsyncCollectiveTensor`` gradient and gets a
    plain one (measured, torch 2.13, compile + tensor parallel). ``AsyncCollectiveTensor.wait()``
    alone returns the inner tensor detached: no gradient would reach anything before it."""

    @staticmethod
    def forward(ctx, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        return t.wait() if isinstance(t, AsyncCollectiveTensor) else t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _Waited.apply(t) if t.requires_grad else _Waited.forward(None, t)


class _Rowwise(RowwiseParallel):
    """``RowwiseParallel`` whose local output (reduce-scattered sequence slices) is waited."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs,
                                                 device_mesh)
        return _wait(out)


def _styles(float8: bool):
    """(column-wise, row-wise, prepare-input) styles: torchao's float8 all-gather variants for
    tensorwise float8 layers, torch's otherwise."""
    if float8:
        from kiln.components.torchao_import import import_torchao

        f8tp = import_torchao("torchao.float8.float8_tensor_parallel")
        return f8tp.Float8ColwiseParallel, f8tp.Float8RowwiseParallel, f8tp.PrepareFloat8ModuleInput
    return ColwiseParallel, _Rowwise, PrepareModuleInput


def _linears(module: nn.Module, names: tuple[str, ...]) -> list[nn.Module] | None:
    found = [getattr(module, n, None) for n in names]
    if all(isinstance(m, nn.Linear) for m in found):
        return found
    return None


def _all_float8(mods: list[nn.Module], float8: str) -> bool:
    if float8 != "tensorwise":
        return False
    from torchao.float8.float8_linear import Float8Linear

    return all(isinstance(m, Float8Linear) for m in mods)


def _attention_plan(attn: nn.Module, float8: str, sp: Shard,
                    mesh: DeviceMesh) -> tuple[dict, bool]:
    names = next((n for n in ATTENTION_LINEARS if _linears(attn, n) is not None), None)
    if names is None or _linears(attn, ("wo",)) is None:
        raise RecipeError(
            f"tensor parallel has no plan for the attention {type(attn).__name__} (it needs "
            "wq/wk/wv or wqkv and wo Linear layers); model.attention.type = causal or "
            "differential, or parallelism.tp = 1"
        )
    gate = ("wg",) if _linears(attn, ("wg",)) is not None else ()  # the output gate
    f8 = _all_float8(_linears(attn, (*names, *gate, "wo")), float8)
    if f8:
        _check_float8_backend(mesh)
    col, row, prepare = _styles(f8)
    plan = {"attention": prepare(input_layouts=(sp,), desired_input_layouts=(Replicate(),),
                                 use_local_output=not f8)}
    plan.update({f"attention.{n}": col() for n in (*names, *gate)})  # gate: split as q
    plan["attention.wo"] = row(output_layouts=sp)
    return plan, f8


def _ffn_plan(ffn: nn.Module, float8: str, sp: Shard, mesh: DeviceMesh) -> tuple[dict, bool]:
    from kiln.components.ffn.moe import MoE

    if isinstance(ffn, MoE):
        return {}, False  # routes its own sequence slice; its parameters are summed over tp
    for names in (SWIGLU_LINEARS, MLP_LINEARS):
        mods = _linears(ffn, names)
        if mods is not None:
            break
    else:
        raise RecipeError(
            f"tensor parallel has no plan for the feed-forward {type(ffn).__name__} (it needs "
            "w1/w3/w2 or w1/w2 Linear layers, or an MoE); model.ffn.type = swiglu, mlp or moe, "
            "or parallelism.tp = 1"
        )
    f8 = _all_float8(mods, float8)
    if f8:
        _check_float8_backend(mesh)
    col, row, prepare = _styles(f8)
    return {
        "feed_forward": prepare(input_layouts=(sp,), desired_input_layouts=(Replicate(),),
                                use_local_output=not f8),
        **{f"feed_forward.{n}": col() for n in names[:-1]},  # w1 (and SwiGLU's gate w3)
        "feed_forward.w2": row(output_layouts=sp),
    }, f8


def _set_head_offsets(block: nn.Module, rank: int, size: int) -> None:
    attn = block.attention
    if hasattr(attn, "head_offset"):
        attn.head_offset = rank * (attn.n_heads // size)


def apply_tensor_parallel(
    model: nn.Module, mesh: DeviceMesh, *, loss_parallel: bool, float8: str = "off"
) -> TensorParallel:
    """Plan ``model`` over the 1-D tensor-parallel ``mesh`` in place (see the module doc)."""
    sp = Shard(1)  # the sequence dimension of (B, T, dim)
    tp = TensorParallel(mesh=mesh, loss_parallel=loss_parallel)
    tied = getattr(model, "tied", False)
    pruned = {n for names in getattr(model, "pipeline_ends", {}).values() for n in names}
    for name in ("tok_embeddings", "norm", "output"):
        if getattr(model, name, None) is None and name in pruned:
            continue  # a pipeline stage that does not hold it
        if not isinstance(getattr(model, name, None), nn.Module):
            raise RecipeError(
                f"tensor parallel needs a model with tok_embeddings, norm and output "
                f"(transformer, looped); {type(model).__name__} has no {name}"
            )
    top = {
        "tok_embeddings": _Rowwise(input_layouts=Replicate(), output_layouts=sp),
        "norm": SequenceParallel(use_local_output=True),
        "output": ColwiseParallel(
            input_layouts=sp, output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if isinstance(getattr(model, "state_norm", None), nn.Module):
        top["state_norm"] = SequenceParallel(use_local_output=True)
    top = {name: style for name, style in top.items() if getattr(model, name) is not None}
    parallelize_module(model, mesh, top)
    if tied and model.output is not None and model.tok_embeddings is not None:
        # both plans shard the (vocab, dim) matrix by rows: keep one parameter
        model.output.weight = model.tok_embeddings.weight
    rank = mesh.get_local_rank()
    for block in model_blocks(model):
        plan = {
            "attention_norm": SequenceParallel(use_local_output=True),
            "ffn_norm": SequenceParallel(use_local_output=True),
        }
        attn_plan, f8a = _attention_plan(block.attention, float8, sp, mesh)
        ffn_plan, f8f = _ffn_plan(block.feed_forward, float8, sp, mesh)
        parallelize_module(block, mesh, {**plan, **attn_plan, **ffn_plan})
        _set_head_offsets(block, rank, mesh.size())
        tp.float8_styles |= f8a or f8f
    tp.partial_params = [clean_name(n) for n, p in model.named_parameters()
                         if not isinstance(p, DTensor)]
    return tp

"""The dispatch helpers of the MoE layer on their own: sorting, both kernels, and autocast."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.components.errors import RecipeError
from kiln.components.ffn.moe_dispatch import (
    experts_grouped,
    experts_loop,
    grouped_mm_works,
    run_experts,
    sort_by_expert,
)

E, D, FF = 4, 8, 12


def weights(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(*s, generator=g) * 0.3).requires_grad_()
                 for s in ((E, D, FF), (E, D, FF), (E, FF, D)))


def per_token(xs, w1, w3, w2, expert_ids):
    """Reference: each row through its own expert, one at a time."""
    return torch.stack([(F.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]
                        for x, e in zip(xs, expert_ids.tolist(), strict=True)])


def test_sort_by_expert_is_stable_and_counts():
    ids = torch.tensor([2, 0, 2, 1, 0, 2])
    order, counts = sort_by_expert(ids, n_experts=E)
    assert order.tolist() == [1, 4, 3, 0, 2, 5]
    assert counts.tolist() == [2, 1, 3, 0]


def kernels():
    out = [pytest.param(experts_loop, id="loop")]
    marks = [] if grouped_mm_works("cpu", torch.float32) else [
        pytest.mark.skip(reason="torch._grouped_mm unavailable for fp32 on CPU")]
    out.append(pytest.param(experts_grouped, id="grouped", marks=marks))
    return out


@pytest.mark.parametrize("kernel", kernels())
def test_kernels_match_per_token_reference_forward_and_backward(kernel):
    torch.manual_seed(0)
    ids = torch.tensor([3, 0, 3, 1, 0, 3, 3, 0, 1])  # expert 2 has no rows
    order, counts = sort_by_expert(ids, E)
    xs = torch.randn(len(ids), D, requires_grad=True)
    w = weights()
    out = kernel(xs[order], *w, counts)
    ref = per_token(xs[order], *w, ids[order])
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)

    out.sum().backward()  # the expanded upstream gradient that _grouped_mm once rejected
    got = [xs.grad.clone()] + [t.grad.clone() for t in w]
    for t in (xs, *w):
        t.grad = None
    per_token(xs[order], *w, ids[order]).sum().backward()
    for a, b in zip(got, [xs.grad] + [t.grad for t in w], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert w[0].grad[2].abs().sum() == 0  # the expert with no rows gets no gradient


def test_loop_with_no_rows_returns_empty():
    xs = torch.randn(0, D)
    out = experts_loop(xs, *weights(), torch.zeros(E, dtype=torch.long))
    assert out.shape == (0, D)


@pytest.mark.parametrize("kind", ["loop", "grouped", "auto"])
def test_run_experts_kinds_agree(kind):
    if kind == "grouped" and not grouped_mm_works("cpu", torch.float32):
        pytest.skip("torch._grouped_mm unavailable for fp32 on CPU")
    torch.manual_seed(1)
    ids = torch.randint(0, E, (10,))
    order, counts = sort_by_expert(ids, E)
    xs = torch.randn(10, D)[order]
    w = weights(1)
    torch.testing.assert_close(run_experts(kind, xs, *w, counts),
                               experts_loop(xs, *w, counts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("width", "dtype"), [(7, torch.float32), (12, torch.bfloat16)])
def test_auto_takes_the_loop_where_grouped_mm_cannot_take_the_widths(width, dtype):
    """_grouped_mm wants rows of a multiple of 16 bytes: hidden_dim = 7 raised "strides should
    be multiple of 16 bytes" from the first forward of an auto-dispatched model."""
    ids = torch.tensor([0, 1, 1, 3, 2, 2])
    order, counts = sort_by_expert(ids, E)
    xs = torch.randn(6, D, dtype=dtype)[order]
    g = torch.Generator().manual_seed(0)
    w = tuple(torch.randn(*s, generator=g, dtype=dtype)
              for s in ((E, D, width), (E, D, width), (E, width, D)))
    torch.testing.assert_close(run_experts("auto", xs, *w, counts), experts_loop(xs, *w, counts))
    with pytest.raises(RecipeError, match=r"model.ffn.dispatch = \"grouped\": torch._grouped_mm "
                       rf"needs widths that are a multiple of {16 // dtype.itemsize}"):
        run_experts("grouped", xs, *w, counts)


def test_a_compiled_fp32_model_takes_the_loop():
    """torch.compile traces _grouped_mm through its fake-tensor kernel, which takes bf16 only:
    looped_moe_debug.toml with parallelism.compile = true failed to trace ("Expected inputs of
    BF16 type"). Checked by hand: that run now trains (2 steps, 45 s here)."""
    from kiln.components.ffn.moe_dispatch import resolve_kernel

    cpu = torch.device("cpu")
    assert resolve_kernel("auto", cpu, torch.float32, (8, 12), compiling=True) == "loop"
    assert resolve_kernel("loop", cpu, torch.float32, (8, 12), compiling=True) == "loop"
    assert resolve_kernel("auto", cpu, torch.bfloat16, (8, 16), compiling=True) == \
        resolve_kernel("auto", cpu, torch.bfloat16, (8, 16))
    with pytest.raises(RecipeError, match="traces torch._grouped_mm in bfloat16 only"):
        resolve_kernel("grouped", cpu, torch.float32, (8, 12), compiling=True)


def test_run_experts_casts_to_the_autocast_dtype():
    ids = torch.tensor([0, 1, 1, 3])
    order, counts = sort_by_expert(ids, E)
    xs = torch.randn(4, D)[order]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run_experts("loop", xs, *weights(), counts)
    assert out.dtype == torch.bfloat16


def test_kernel_choice_is_marked_constant_the_way_torch_compile_reads_it():
    """resolve_kernel sets by hand what torch.compiler.assume_constant_result sets (the decorator
    imports torch._dynamo at import time); if torch changes the marker, this fails."""
    from torch._dynamo.decorators import assume_constant_result

    from kiln.components.ffn.moe_dispatch import resolve_kernel

    marked = assume_constant_result(lambda: None)
    names = [n for n in vars(marked) if n.startswith("_dynamo")]
    assert names and all(getattr(resolve_kernel, n, None) == getattr(marked, n) for n in names)

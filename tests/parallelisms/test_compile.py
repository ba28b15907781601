from __future__ import annotations

import pytest
import torch

from kiln.components.errors import KilnError
from kiln.parallelisms import compile as compile_mod
from kiln.parallelisms.activation_checkpoint import apply_activation_checkpoint
from kiln.parallelisms.config import ParallelismConfig
from tests.parallelisms.tiny import batches, loss_fn, tiny_model

CPU = torch.device("cpu")


@pytest.mark.slow
def test_compiled_blocks_match_eager():
    """One tiny compile test (compiling is slow here): per-block compile over selective AC.
    Every block is checkpointed alike, so the two share one compiled graph (a second, differently
    wrapped block would double the C++ compilation: ~15 s here)."""
    cfg = ParallelismConfig(compile=True, activation_checkpoint="selective", ac_every=1)
    eager, compiled = tiny_model(seed=2, n_layers=2), tiny_model(seed=2, n_layers=2)
    apply_activation_checkpoint(compiled, cfg)
    assert compile_mod.apply_compile(compiled, cfg, CPU) == "compile per block"
    # compiled in place: names are unchanged apart from the AC wrapper
    assert not any("_orig_mod" in n for n, _ in compiled.named_parameters())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, compiled)]
    for seqs in batches(0, 2, 4):
        losses = []
        for model, opt in zip((eager, compiled), opts, strict=True):
            opt.zero_grad()
            loss = loss_fn(model, seqs)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-4, atol=1e-5)


def test_missing_cpp_compiler_is_a_clear_error(monkeypatch):
    from torch._inductor import cpp_builder, exc

    def missing():
        raise exc.InvalidCxxCompiler

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", missing)
    with pytest.raises(KilnError, match="C\\+\\+ compiler.*install g\\+\\+.*compile = false"):
        compile_mod.apply_compile(tiny_model(meta=True), ParallelismConfig(compile=True), CPU)


def test_off_leaves_blocks_alone():
    model = tiny_model(meta=True)
    assert compile_mod.apply_compile(model, ParallelismConfig(), CPU) == ""
    assert all(b._compiled_call_impl is None for b in model.blocks())
    fn = lambda x: x  # noqa: E731
    assert compile_mod.compile_loss(fn, ParallelismConfig(), CPU) is fn


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_a_backend_that_generates_no_code_needs_no_cpp_compiler(backend, monkeypatch):
    from torch._inductor import cpp_builder

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", lambda: pytest.fail("checked g++"))
    cfg = ParallelismConfig(compile=True, compile_loss=True, compile_backend=backend)
    model = tiny_model(meta=True)
    assert compile_mod.apply_compile(model, cfg, CPU) == f"compile per block ({backend})"
    assert all(b._compiled_call_impl is not None for b in model.blocks())
    loss = lambda x: x  # noqa: E731
    assert compile_mod.compile_loss(loss, cfg, CPU) is not loss


@pytest.mark.slow
def test_a_compiled_gated_deltanet_layer_matches_eager():
    """Gated DeltaNet's chunked form (a triangular solve, a loop over chunks) under inductor:
    forward and input gradient equal eager. (The aot_eager debugging backend fails on it: its
    backward views gradients whose runtime strides differ from the traced ones, a torch issue.)"""
    from kiln.components.attention.gated_deltanet import GatedDeltaNetConfig

    cfg = GatedDeltaNetConfig(type="gated_deltanet", n_heads=2, head_dim=8, chunk_size=8)
    _compiled_layer_equals_eager(cfg)


def _compiled_layer_equals_eager(cfg) -> None:
    """An attention layer of ``cfg`` (width 16) under inductor: output and input gradient."""
    torch.manual_seed(0)
    layer = cfg.build(dim=16, layer_idx=0, n_layers=1, max_seq_len=32)
    x = torch.randn(2, 16, 16, requires_grad=True)
    ref = layer(x)
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), x)
    compiled = torch.compile(layer, backend="inductor")
    out = compiled(x)
    (grad,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_compiled_latent_attention_layer_matches_eager():
    """Multi-head latent attention (a query latent, the decoupled RoPE key, SDPA over the
    expanded keys) under inductor: forward and input gradient equal eager; RoPE takes its
    real-valued form when compiled."""
    from kiln.components.base import default_config

    cfg = default_config("attention", "latent", n_heads=2, q_rank=12, kv_rank=12,
                         nope_head_dim=8, rope_head_dim=8, v_head_dim=8)
    _compiled_layer_equals_eager(cfg)

from __future__ import annotations

import pytest
import torch
from torch import nn

import kiln.parallelisms.float8 as f8
from kiln.components.errors import KilnError
from kiln.parallelisms.config import ParallelismConfig
from tests.parallelisms.tiny import batches, loss_fn, tiny_model

CPU = torch.device("cpu")


class Mixed(nn.Module):
    """One layer per filter rule."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 64)
        self.ok = nn.Linear(64, 128)  # converted
        self.small = nn.Linear(64, 32)  # out_features < min_dim
        self.odd = nn.Linear(72, 64)  # 72 is not a multiple of 16
        self.pre_norm = nn.Linear(64, 64)  # name matches *norm*
        self.inner = nn.Sequential(nn.Linear(128, 64))  # converted (inner.0)
        self.output = nn.Linear(64, 64)  # the LM head


def _float8_names(model: nn.Module) -> list[str]:
    from torchao.float8.float8_linear import Float8Linear

    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def test_filter_converts_exactly_the_allowed_layers():
    # the filter does not depend on the recipe; tensorwise runs on CPU with every torch
    model = Mixed()
    converted, note = f8.apply_float8(model, ParallelismConfig(float8="tensorwise"), CPU, False)
    assert note == ""
    assert converted == ["ok", "inner.0"] == _float8_names(model)


def test_transformer_converts_block_linears_only():
    model = tiny_model(meta=True)  # conversion works on meta, before materialisation
    converted, _ = f8.apply_float8(model, ParallelismConfig(float8="tensorwise"), CPU, False)
    assert len(converted) == 3 * 7  # wq wk wv wo w1 w2 w3 per block
    assert all(n.startswith("layers.") for n in converted)
    assert "output" not in converted


def test_min_dim_and_exclude_are_configurable():
    cfg = ParallelismConfig(float8="tensorwise", float8_exclude=["inner.*"])
    assert f8.apply_float8(Mixed(), cfg, CPU, False)[0] == ["ok"]
    cfg = ParallelismConfig(float8="tensorwise", float8_min_dim=32)
    assert f8.apply_float8(Mixed(), cfg, CPU, False)[0] == ["ok", "small", "inner.0"]


def test_off_converts_nothing():
    model = Mixed()
    assert f8.apply_float8(model, ParallelismConfig(), CPU, False) == ([], "")
    assert _float8_names(model) == []


def test_unsupported_hardware_fails_or_falls_back_unless_emulated(monkeypatch):
    monkeypatch.setattr(f8, "float8_support", lambda device, recipe="": "A100 has no fp8")
    with pytest.raises(KilnError, match="A100 has no fp8.*float8_fallback = true"):
        f8.apply_float8(Mixed(), ParallelismConfig(float8="rowwise", float8_emulate="off"), CPU,
                        False)
    model = Mixed()
    cfg = ParallelismConfig(float8="rowwise", float8_fallback=True, float8_emulate="off")
    converted, note = f8.apply_float8(model, cfg, CPU, False)
    assert converted == [] and "skipped" in note and _float8_names(model) == []
    # emulated float8 needs no fp8 hardware: on CPU by default, anywhere with "on"
    assert f8.apply_float8(Mixed(), ParallelismConfig(float8="rowwise"), CPU, False)[0]
    cuda = ParallelismConfig(float8="rowwise", float8_emulate="on")
    assert f8.apply_float8(Mixed(), cuda, torch.device("cuda"), False)[0] == ["ok", "inner.0"]


def test_emulation_is_on_for_cpu_and_off_for_gpus_by_default():
    auto, on, off = (ParallelismConfig(float8="rowwise", float8_emulate=e)
                     for e in ("auto", "on", "off"))
    gpu = torch.device("cuda")
    assert f8.float8_emulated(auto, CPU) and not f8.float8_emulated(auto, gpu)
    assert f8.float8_emulated(on, gpu) and not f8.float8_emulated(off, CPU)
    model = Mixed()
    f8.apply_float8(model, auto, CPU, False)
    assert model.ok.config.emulate
    model = Mixed()
    f8.apply_float8(model, off, CPU, False)
    assert not model.ok.config.emulate


def test_cpu_is_supported():
    assert f8.float8_support(CPU) is None


def test_fsdp_float8_all_gather_only_for_tensorwise():
    cfg = ParallelismConfig(float8="tensorwise")
    assert f8.float8_config(cfg, fsdp=True).enable_fsdp_float8_all_gather
    assert not f8.float8_config(cfg, fsdp=False).enable_fsdp_float8_all_gather
    rowwise = ParallelismConfig(float8="rowwise")
    assert not f8.float8_config(rowwise, fsdp=True).enable_fsdp_float8_all_gather


def _train_float8(recipe: str, steps: int, emulate: str = "auto") -> list[float]:
    model = tiny_model(seed=0)
    cfg = ParallelismConfig(float8=recipe, float8_emulate=emulate)
    converted, _ = f8.apply_float8(model, cfg, CPU, False)
    assert converted
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for seqs in batches(0, steps, 8):
        opt.zero_grad()
        loss = loss_fn(model, seqs)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_trains_on_cpu(recipe):
    losses = _train_float8(recipe, 8)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_emulated_float8_equals_the_scaled_mm_kernel_to_float32_rounding(recipe):
    # the same casts and scales; only the product differs: float32 matmul against the CPU
    # torch._scaled_mm kernel (3 steps: each of its 63 fp8 matmuls per step takes milliseconds)
    if recipe != "tensorwise" and not f8.cpu_rowwise_scaled_mm():
        pytest.skip(f"torch {torch.__version__}: no row-wise torch._scaled_mm on CPU")
    kernel = _train_float8(recipe, 3, emulate="off")
    assert _train_float8(recipe, 3) == pytest.approx(kernel, rel=1e-4)


def test_cpu_without_rowwise_scaled_mm_is_a_clear_error_unless_emulated(monkeypatch):
    monkeypatch.setattr(f8, "cpu_rowwise_scaled_mm", lambda: False)
    with pytest.raises(KilnError, match="row-wise scaled matmul on CPU"):
        f8.apply_float8(Mixed(), ParallelismConfig(float8="rowwise", float8_emulate="off"), CPU,
                        False)
    converted, _ = f8.apply_float8(Mixed(), ParallelismConfig(float8="tensorwise",
                                                              float8_emulate="off"), CPU, False)
    assert converted
    assert f8.apply_float8(Mixed(), ParallelismConfig(float8="rowwise"), CPU, False)[0]

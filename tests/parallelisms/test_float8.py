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


@pytest.mark.parametrize("recipe, overrides, pad", [
    ("debug.toml", [], False),  # 4 x 256 tokens a micro-batch: always a multiple of 16
    ("debug.toml", ["--training.micro_batch=1", "--training.global_batch=1",
                    "--training.seq_len=100"], True),
    ("debug.toml", ["--training.micro_batch=1", "--training.global_batch=1",
                    "--training.seq_len=100", "--parallelism.float8=rowwise_with_gw_hp"], False),
    ("debug.toml", ["--parallelism.cp=2", "--training.micro_batch=1", "--training.seq_len=16",
                    "--training.global_batch=1"], True),  # 8 tokens on each rank
    ("debug.toml", ["--training.context_warmup.steps=10", "--training.context_warmup.multiple=8",
                    "--training.micro_batch=1", "--training.global_batch=1"], True),
    ("debug.toml", ["--parallelism.float8_pad_inner_dim=off", "--training.seq_len=100",
                    "--training.micro_batch=1", "--training.global_batch=1"], False),
    ("debug.toml", ["--parallelism.float8_pad_inner_dim=on"], True),
    ("dpo_debug.toml", [], True),  # rows cut after their last label, prompts packed once
    ("grpo_debug.toml", [], True),
])
def test_the_inner_dimension_is_padded_where_a_micro_batch_can_miss_16_tokens(
        recipe, overrides, pad):
    from kiln.recipes.config.files import load_recipe
    from tests.conftest import CONFIGS

    loaded = load_recipe(CONFIGS / recipe, ["--parallelism.float8=rowwise", *overrides])
    cfg = loaded.parallelism
    assert f8.float8_pad(cfg, loaded.training, cfg.cp) is pad
    assert f8.float8_config(cfg, fsdp=False, pad=pad).pad_inner_dim is pad


def test_padding_meets_the_gpu_kernels_multiple_of_16_on_24_tokens(monkeypatch):
    """A GPU's torch._scaled_mm takes inner dimensions that are multiples of 16 only (the CPU
    kernel takes any): with that check put on the CPU kernel, 24 tokens fail in the weight
    gradient (its inner dimension is the token count) unpadded, and pass padded, with the
    same result as the emulation."""
    real = torch._scaled_mm

    def gpu_like(a, b, *args, **kwargs):
        if a.shape[1] % 16 or b.shape[0] % 16 or b.shape[1] % 16:
            raise RuntimeError(f"inner dimensions {tuple(a.shape)} @ {tuple(b.shape)}")
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", gpu_like)
    x = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    grads = {}
    for pad, emulate in ((False, "off"), (True, "off"), (True, "on")):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 128))
        cfg = ParallelismConfig(float8="tensorwise", float8_emulate=emulate)
        assert f8.apply_float8(model, cfg, CPU, False, pad)[0] == ["0"]
        loss = model(x).square().sum()
        if not pad:
            with pytest.raises(RuntimeError, match=r"inner dimensions \(128, 24\)"):
                loss.backward()
            continue
        loss.backward()
        grads[emulate] = model[0].weight.grad
    torch.testing.assert_close(grads["off"], grads["on"], rtol=1e-4, atol=1e-4)

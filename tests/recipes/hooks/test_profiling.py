"""[run.profile] (torch.profiler trace, CUDA memory snapshots, CPU peak RSS per phase) and honest
MFU (the peak of the GEMM dtype from a table by device name, a probe elsewhere, never above
100%)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from kiln.recipes.probes.flops import Peak, gemm_dtype, mfu, peak_flops, table_peak
from tests.recipes.test_combinations import recipe_for, train


@pytest.mark.parametrize("name, dtype, want", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989e12),
    ("NVIDIA H100 PCIe", "bf16", 756e12),
    ("NVIDIA H200", "fp8", 1979e12),
    ("NVIDIA L40S", "bf16", 362e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA A100-SXM4-80GB", "tf32", 156e12),
    ("NVIDIA A100-SXM4-80GB", "fp8", None),  # no fp8 tensor cores: the probe decides
    ("Some Future GPU", "bf16", None),
])
def test_the_table_by_device_name_and_dtype(name, dtype, want):
    assert table_peak(name, dtype) == want


def test_gemm_dtype_and_mfu_never_clipped():
    from kiln.parallelisms.config import ParallelismConfig
    from kiln.recipes.config.schema import TrainingConfig

    bf16, fp32 = TrainingConfig(mixed_precision="bf16"), TrainingConfig()
    assert gemm_dtype(bf16, ParallelismConfig(), True, "cuda") == "fp8"
    # emulated float8 (the CPU default) multiplies in float32: that peak, not fp8's
    assert gemm_dtype(bf16, ParallelismConfig(), True, "cpu", float8_emulated=True) == "fp32"
    assert gemm_dtype(fp32, ParallelismConfig(param_dtype="bfloat16"), False, "cpu") == "bf16"
    assert gemm_dtype(bf16, ParallelismConfig(), False, "cpu") == "bf16"
    assert gemm_dtype(fp32, ParallelismConfig(param_dtype="float32"), False, "cpu") == "fp32"
    assert mfu(50.0, 100.0) == 0.5 and mfu(101.0, 100.0) == 1.01 and mfu(1.0, 0.0) is None


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_cpu_peaks_are_measured_in_the_gemm_dtype(dtype):
    peak = peak_flops("cpu", dtype)
    # A measured figure, not a placeholder: even one busy core does 1e6 FLOP/s in any dtype
    # (fp8 through _scaled_mm on one thread of a loaded 2-core box measured 2.4e7).
    assert peak.flops > 1e6 and peak.dtype == dtype
    assert peak.notice().startswith("mfu: against ") and f"{dtype} matmul probe" in peak.notice()


def test_a_measured_peak_is_measured_once_per_machine_and_cached(tmp_path, monkeypatch):
    """A start-up probe moves with the machine's load; the cached one does not: measured once
    per (CPU model, threads, dtype, torch version), the best of several rounds, written
    atomically; a corrupt cache file is measured again with a warning."""
    import kiln.recipes.probes.flops as flops

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    rates = iter([1e9, 3e9, 2e9, 5e9, 4e9] * 3)
    calls = []
    monkeypatch.setattr(flops, "matmul_probe", lambda *a, **k: calls.append(1) or next(rates))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    flops.peak_flops.cache_clear()
    first = flops.peak_flops("cpu", "fp32")
    assert first.flops == 5e9 and len(calls) == 5  # the best round
    path = tmp_path / "cache" / "peak_flops.json"
    (key, entry), = json.loads(path.read_text()).items()
    assert ", 1 thread | fp32 | torch " in key and torch.__version__ in key
    assert flops.cpu_model() in key and entry["flops"] == 5e9
    assert ", 1 thread, fp32 matmul probe measured now" in first.notice()
    flops.peak_flops.cache_clear()
    again = flops.peak_flops("cpu", "fp32")
    assert again.flops == 5e9 and len(calls) == 5
    assert "measured once on this machine, cached in" in again.notice()
    assert not list(path.parent.glob("*.tmp"))
    path.write_text("{not json")
    flops.peak_flops.cache_clear()
    redone = flops.peak_flops("cpu", "fp32")
    assert len(calls) == 10 and redone.flops == 5e9
    assert "not a peak cache" in redone.warning and "measured again" in redone.warning
    assert json.loads(path.read_text())[key]["flops"] == 5e9
    flops.peak_flops.cache_clear()


def test_the_peak_line_comes_before_any_step_or_checkpoint_line(tmp_path):
    """The peak is found when training starts: a resumed run under max_hours saves before its
    first log line, and the mfu: line still comes first."""
    args = ("--checkpoint.enable=true", "--training.max_hours=1",
            "--checkpoint.interval_minutes=0.0001", "--run.log_interval=10")
    train(recipe_for("dense", tmp_path / "r", "--training.steps=1", *args))
    out = io.StringIO()
    train(recipe_for("dense", tmp_path / "r", "--training.steps=3", *args), out=out)
    lines = out.getvalue().splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith(("kiln: checkpoint", "step ")))
    assert any(x.startswith("mfu: against") for x in lines[:first])


def test_an_mfu_above_100_percent_is_logged_with_its_peak_and_a_warning(tmp_path, monkeypatch):
    """Never clipped: dropping values above 100% and keeping 99% biased the series."""
    import kiln.recipes.probes.flops as flops

    monkeypatch.setattr(flops, "peak_flops", lambda *a: Peak(1e3, "fp32", "a test"))
    out = io.StringIO()
    train(recipe_for("dense", tmp_path / "r", "--training.steps=1"), out=out)
    assert "mfu: against 1e-09 TFLOP/s per device, fp32 (a test)" in out.getvalue()
    assert "that peak is too low for this device; measuring it again" in out.getvalue()
    assert "still above 100%" in out.getvalue()
    line = json.loads((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()[0])
    assert line["mfu"] > 1 and line["mfu_peak_tflops"] == 1e-9


def test_a_cached_peak_below_what_a_run_achieved_is_measured_again(tmp_path, monkeypatch):
    import kiln.recipes.probes.flops as flops

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(flops, "machine_load", lambda: 0.1)
    rates = iter([1e9, 1e9, 1e9, 1e9, 1e9, 4e9, 3e9, 4e9, 4e9, 4e9])
    monkeypatch.setattr(flops, "matmul_probe", lambda *a, **k: next(rates))
    assert flops.measured_peak("fp32", "cpu")[0] == 1e9  # measured while the box was busy
    assert flops.measured_peak("fp32", "cpu")[0] == 1e9  # cached
    rate, where, _ = flops.measured_peak("fp32", "cpu", at_least=2e9)
    assert rate == 4e9 and "measured again (below the 0.002 TFLOP/s a run achieved)" in where
    (entry,) = json.loads((tmp_path / "cache" / "peak_flops.json").read_text()).values()
    assert entry["flops"] == 4e9 and entry["load"] == 0.1


def test_a_peak_measured_under_load_is_measured_again_when_quieter(tmp_path, monkeypatch):
    import kiln.recipes.probes.flops as flops

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "cache"))
    load = {"now": 1.5}
    monkeypatch.setattr(flops, "machine_load", lambda: load["now"])
    rates = iter([1e9] * 5 + [3e9] * 5 + [2e9] * 5)
    monkeypatch.setattr(flops, "matmul_probe", lambda *a, **k: next(rates))
    assert flops.measured_peak("fp32", "cpu")[0] == 1e9
    assert flops.measured_peak("fp32", "cpu")[0] == 1e9  # as busy as then: cached
    load["now"] = 0.2
    rate, where, _ = flops.measured_peak("fp32", "cpu")
    assert rate == 3e9 and "measured under load 1.50 per core, now 0.20" in where
    load["now"] = 1.5  # the entry now holds load 0.2: trusted whatever the load is now
    assert flops.measured_peak("fp32", "cpu")[0] == 3e9

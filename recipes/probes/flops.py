"""Peak FLOP/s for MFU, in the dtype the GEMMs actually run in: a datasheet table by GPU name
and dtype, a measured matmul probe where the table has no entry (CPU, unknown GPUs), and a
one-line notice naming the peak used. ``mfu()`` never clips: an MFU above 100% means the peak
is wrong, and the log says so and measures a probe's peak again (peers shipped >100% MFU on new
GPUs, OLMo-core #817, torchtitan #1201); dropping those values would bias the series.

A probe timed at start-up moves with whatever else the machine runs (6x between two runs on a
shared box), and MFU would move with it: a measured peak is measured once per machine (CPU
model or GPU name, thread count, dtype, torch version; the best of several rounds) and cached
in ``$KILN_CACHE/peak_flops.json``, so runs of one machine share one peak. The cache keeps the
load the machine had then: a peak measured under load is measured again when the machine is
quieter, and any run that achieves more than the cached peak measures it again; the cache only
ever keeps the best figure seen."""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

# Dense peaks (no structured sparsity), TFLOP/s per GPU, from the vendors' datasheets (SXM
# parts unless named). fp32 is the non-tensor-core rate; tf32 where float32 matmuls may use
# tensor cores (torch.backends.cuda.matmul.allow_tf32). Checked first to last: longer names
# before the names they contain ("H100 PCIe" before "H100", "L40S" before "L4").
GPU_PEAKS: dict[str, dict[str, float]] = {
    "B200": {"fp8": 4500, "bf16": 2250, "tf32": 1100, "fp32": 80},
    "H200": {"fp8": 1979, "bf16": 989, "tf32": 494, "fp32": 67},
    "H100 PCIe": {"fp8": 1513, "bf16": 756, "tf32": 378, "fp32": 51},
    "H100": {"fp8": 1979, "bf16": 989, "tf32": 494, "fp32": 67},
    "A100": {"bf16": 312, "tf32": 156, "fp32": 19.5},  # no fp8 tensor cores
    "L40S": {"fp8": 733, "bf16": 362, "tf32": 183, "fp32": 91.6},
    "A10G": {"bf16": 125, "tf32": 62.5, "fp32": 31.2},
    "L4": {"fp8": 242, "bf16": 121, "tf32": 60, "fp32": 30.3},
}
DTYPES = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32,
          "tf32": torch.float32}


@dataclass(frozen=True)
class Peak:
    flops: float  # per device; 0 = unknown (no MFU)
    dtype: str  # fp8, bf16, tf32, fp32
    source: str  # where the number comes from
    warning: str = ""  # e.g. an unreadable peak cache, measured again

    def notice(self) -> str:
        if not self.flops:
            return f"mfu: not reported: no peak for {self.source} {self.dtype}"
        return (f"mfu: against {self.flops / 1e12:.4g} TFLOP/s per device, {self.dtype} "
                f"({self.source})")


def gemm_dtype(training, parallelism, float8: bool, device_type: str,
               float8_emulated: bool = False) -> str:
    """The dtype the model's GEMMs run in (``[training]`` and ``[parallelism]`` tables): fp8
    when float8 converted layers (fp32 when those matmuls are emulated), bf16 under autocast
    or bf16 parameters, else fp32 (tf32 on CUDA where torch allows it)."""
    if float8:
        return "fp32" if float8_emulated else "fp8"
    if training.mixed_precision == "bf16" or parallelism.param_dtype == "bfloat16":
        return "bf16"
    if device_type == "cuda" and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


def table_peak(device_name: str, dtype: str) -> float | None:
    for key, peaks in GPU_PEAKS.items():
        if key in device_name:
            return peaks[dtype] * 1e12 if dtype in peaks else None
    return None


@functools.lru_cache(maxsize=8)
def peak_flops(device_type: str, dtype: str = "fp32", at_least: float = 0.0) -> Peak:
    """The peak for MFU: the datasheet on a GPU of the table, else a measured probe (on CPU:
    the achievable GEMM rate with the current thread count, not a theoretical number), measured
    again if below ``at_least``."""
    if device_type == "cuda":
        name = torch.cuda.get_device_name()
        value = table_peak(name, dtype)
        if value is not None:
            return Peak(value, dtype, f"{name}, datasheet dense peak")
    elif device_type != "cpu":  # no table for other accelerators, nor a synchronised probe
        return Peak(0.0, dtype, f"{device_type} (no datasheet table, no probe)")
    try:
        rate, cached, warning = measured_peak(dtype, device_type, at_least=at_least)
    except (RuntimeError, TypeError, NotImplementedError) as exc:  # e.g. no fp8 matmul here
        return Peak(0.0, dtype, f"{device_type} (the {dtype} probe failed: {exc})")
    return Peak(rate, dtype, f"{machine(device_type)}, {dtype} matmul probe {cached}", warning)


PROBE_ROUNDS = 5  # the best round is the peak: a round slowed by other work does not count
PROBE_BUDGET_S = 2.0  # fewer rounds where one is slow (fp8 through _scaled_mm on a CPU)


def machine(device_type: str) -> str:
    """What a measured peak belongs to: the GPU's name, or the CPU model and thread count."""
    if device_type == "cuda":
        return torch.cuda.get_device_name()
    threads = torch.get_num_threads()
    return f"cpu {cpu_model()}, {threads} thread{'s' * (threads != 1)}"


def cpu_model() -> str:
    info = Path("/proc/cpuinfo")
    for line in (info.read_text(errors="replace").splitlines() if info.is_file() else []):
        if line.startswith("model name") and ":" in line:
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def peak_cache() -> Path:
    """Measured peaks of this machine: beside kiln's data cache ($KILN_CACHE)."""
    return Path(os.environ.get("KILN_CACHE") or "~/.cache/kiln").expanduser() / "peak_flops.json"


def measured_peak(dtype: str, device_type: str, *,
                  at_least: float = 0.0) -> tuple[float, str, str]:
    """(FLOP/s, where it came from, a warning or ""): the cached measurement of this machine,
    else the best of ``PROBE_ROUNDS`` probes, then cached. The cached one is measured again
    when it is implausible: below ``at_least`` (a rate a run achieved), or taken under a load
    that has since fallen; the cache keeps the higher of the two."""
    path, key = peak_cache(), f"{machine(device_type)} | {dtype} | torch {torch.__version__}"
    entries, warning = read_peak_cache(path)
    entry = entries.get(key)
    cached = float(entry["flops"]) if isinstance(entry, dict) and _positive(
        entry.get("flops")) else 0.0
    why = ""
    if cached and at_least > cached:
        why = f"below the {at_least / 1e12:.4g} TFLOP/s a run achieved"
    elif cached and _load(entry) > max(LOAD_PLAUSIBLE, machine_load() + 0.25):
        why = f"measured under load {_load(entry):.2f} per core, now {machine_load():.2f}"
    if cached and not why:
        return cached, f"measured once on this machine, cached in {path}", warning
    rates, started = [], time.perf_counter()
    while len(rates) < PROBE_ROUNDS and time.perf_counter() - started < PROBE_BUDGET_S:
        rates.append(matmul_probe(dtype, device_type, seconds=0.2))
    rate = max(rates)
    if rate <= cached:  # measured again, not higher: the cache keeps its figure
        return cached, f"measured again ({why}), cached in {path}", warning
    entries[key] = {"flops": rate, "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "load": round(machine_load(), 3)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:  # through a temporary file and a rename: a reader never sees half a file
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(entries, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        warning = f"{warning}; " * bool(warning) + f"kiln: warning: {path}: the peak is not " \
            f"cached ({exc}); the next run measures it again"
    done = f"measured again ({why})" if why else "measured now"
    return rate, f"{done}, cached in {path}", warning


LOAD_PLAUSIBLE = 0.5  # runnable processes per core at or below which a probe is trusted


def machine_load() -> float:
    """The 1-minute load average per core (0 where the system does not say)."""
    try:
        return os.getloadavg()[0] / (os.cpu_count() or 1)
    except (AttributeError, OSError):
        return 0.0


def _load(entry: dict) -> float:
    value = entry.get("load", 0.0)
    return float(value) if _positive(value) else 0.0


def read_peak_cache(path: Path) -> tuple[dict, str]:
    """(entries, warning): a missing file is empty; an unreadable one too, with a warning."""
    if not path.is_file():
        return {}, ""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        entries, problem = None, str(exc)
    else:
        problem = "not a JSON object"
    if isinstance(entries, dict):
        return entries, ""
    return {}, (f"kiln: warning: {path}: not a peak cache ({problem}); the peak is measured "
                "again and the file rewritten")


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def matmul_probe(dtype: str = "fp32", device_type: str = "cpu", seconds: float = 0.25) -> float:
    """Measured square-matmul FLOP/s in ``dtype`` (up to 1024^2 on CPU, 8192^2 on CUDA); fp8
    through torch._scaled_mm (what float8 training calls), tf32 with tensor cores allowed."""
    sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
    n = 8192 if device_type == "cuda" else 128
    mm = _square_mm(n, dtype, device_type)
    while device_type != "cuda" and n < 1024:
        # doubled while one matmul is quick: fp8 is emulated on CPUs at ~5e7 FLOP/s, where a
        # 1024^2 product alone takes a minute and a half; timed after a first call, so
        # one-off start-up work (allocation, the thread pool) does not decide the size
        mm()
        start = time.perf_counter()
        mm()
        if time.perf_counter() - start > seconds / 8:
            break
        n *= 2
        mm = _square_mm(n, dtype, device_type)
    mm()  # warm up
    sync()
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or iters < 2:
        mm()
        iters += 1
        if device_type == "cuda":
            sync()
    elapsed = time.perf_counter() - start
    return 2 * n**3 * iters / elapsed


def _square_mm(n: int, dtype: str, device_type: str):
    a = torch.randn(n, n, device=device_type)
    b = torch.randn(n, n, device=device_type)
    if dtype == "fp8":
        one = torch.ones((), device=device_type)
        a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
        return lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)
    a, b = a.to(DTYPES[dtype]), b.to(DTYPES[dtype])
    return lambda: torch.mm(a, b)


def trainer_peak(trainer, at_least: float = 0.0) -> float:
    """The peak for a trainer's MFU, in its GEMM dtype; prints the one-line notice. With
    ``at_least`` (a per-device rate the run achieved above the peak), a measured peak is
    measured again."""
    dtype = gemm_dtype(trainer.recipe.training, trainer.recipe.parallelism,
                       bool(trainer.parallel.float8_modules), trainer.device.type,
                       trainer.parallel.float8_emulated)
    peak = peak_flops(trainer.device.type, dtype, at_least)  # (a new at_least: a new call)
    if peak.warning:
        trainer.print(peak.warning)
    trainer.print(peak.notice())
    return peak.flops


def mfu(achieved_flops: float, peak: float) -> float | None:
    """Model FLOPs utilisation; None without a peak. Not clipped: a value above 1 says the
    peak is wrong, and the caller says so (dropping it would bias the series)."""
    return achieved_flops / peak if peak else None

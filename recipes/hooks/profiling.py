"""``[run.profile]``: torch.profiler over steps [start, stop) and memory records, under
RUN/profile/.

- Trace: ``rankN.<time>.pt.trace.json`` (Chrome trace JSON: open it in Perfetto or
  chrome://tracing; ``tensorboard --logdir RUN/profile`` shows it in the PyTorch profiler
  plugin) and ``rankN_ops.txt``, the operators by total time.
- CUDA: the allocator's history is recorded from the start; ``memory_rankN_stepS.pickle`` is
  dumped after step ``memory_snapshot_step`` and, with ``snapshot_on_oom``, when an allocation
  fails (open it at pytorch.org/memory_viz; torch writes it as a pickle, kiln never reads it).
- CPU has neither: ``memory_rankN.json`` records the process's peak RSS at the end of each
  phase instead (start-up phases, first step, profiled window, end), and the log says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from kiln.components.base import ComponentConfig
from kiln.components.protocols import Hook
from kiln.components.registry import register
from kiln.recipes.probes.process_stats import current_rss_bytes, peak_rss_bytes


class ProfileConfig(ComponentConfig):
    """``[run.profile]``: torch.profiler over steps [start, stop) and memory records."""

    start: int = Field(5, ge=1, description="first profiled step (1-based, as logged)")
    stop: int = Field(8, ge=2, description="profile until this step (exclusive)")
    ranks: Literal["main", "all"] = Field("main", description="profile rank 0 only, or all")
    record_shapes: bool = Field(False, description="record operator input shapes")
    profile_memory: bool = Field(False, description="record tensor allocations in the trace")
    with_stack: bool = Field(False, description="record Python stacks (large traces)")
    memory_snapshot_step: int = Field(
        0, ge=0, description="CUDA: dump a memory snapshot (allocation history) after this step "
        "(0 = none); on CPU the peak RSS per phase is recorded instead")
    snapshot_on_oom: bool = Field(
        True, description="CUDA: dump the memory snapshot when a step runs out of memory")
    max_entries: int = Field(100000, ge=1, description="CUDA allocation events kept for snapshots")

    @model_validator(mode="after")
    def _window(self) -> ProfileConfig:
        if self.stop <= self.start:
            raise ValueError(f"stop ({self.stop}) must be after start ({self.start})")
        return self


@register("hook", "profile", config=ProfileConfig)
class ProfileHook(Hook):
    """torch.profiler over a window of steps, and memory records."""

    priority = 90  # its window brackets the other hooks' work too

    def __init__(self, cfg: ProfileConfig) -> None:
        self.cfg = cfg
        self.profiler = None
        self.active = False
        self.rss: dict[str, dict[str, int]] = {}

    def on_train_start(self, trainer) -> None:
        self.rank = trainer.world.rank
        self.active = self.cfg.ranks == "all" or trainer.world.is_main
        if not self.active:
            return
        self.folder = trainer.run_dir / "profile"
        self.cuda = trainer.device.type == "cuda"
        if self.cuda and (self.cfg.memory_snapshot_step or self.cfg.snapshot_on_oom):
            torch.cuda.memory._record_memory_history(max_entries=self.cfg.max_entries)
            if self.cfg.snapshot_on_oom:
                torch._C._cuda_attach_out_of_memory_observer(self._on_oom)
        elif not self.cuda:
            self.rss.update({f"start-up: {k}": v for k, v in trainer.startup_rss.items()})
            self._phase("start-up done")
            trainer.print(f"profile: {trainer.device.type}: no CUDA memory snapshot here; peak "
                          f"RSS per phase -> {self.folder}/memory_rank{self.rank}.json")
        if trainer.progress.step + 1 == self.cfg.start:
            self._start()

    def _phase(self, name: str) -> None:
        self.rss[name] = {"peak_rss_bytes": peak_rss_bytes(), "rss_bytes": current_rss_bytes()}

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profiler = profile(activities=activities, record_shapes=self.cfg.record_shapes,
                                profile_memory=self.cfg.profile_memory,
                                with_stack=self.cfg.with_stack)
        self.profiler.start()

    def on_step_end(self, trainer, result) -> None:
        if not self.active:
            return
        step = trainer.progress.step
        if step == 1 and not self.cuda:
            self._phase("first step")
        if self.profiler is not None and step + 1 >= self.cfg.stop:
            self._finish(trainer, step)
        elif self.profiler is None and step + 1 == self.cfg.start:
            self._start()
        if step == self.cfg.memory_snapshot_step:
            if self.cuda:
                self._dump(f"memory_rank{self.rank}_step{step}.pickle", trainer)
            else:
                self._phase(f"step {step}")
                self._write_rss(trainer)

    def _finish(self, trainer, step: int) -> None:
        from torch.profiler import tensorboard_trace_handler

        prof, self.profiler = self.profiler, None
        prof.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}")(prof)
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        (self.folder / f"rank{self.rank}_ops.txt").write_text(
            prof.key_averages().table(sort_by=sort, row_limit=40), encoding="utf-8")
        if not self.cuda:
            self._phase(f"profiled steps {self.cfg.start}-{step}")
        trainer.print(f"profile: steps {self.cfg.start}..{step} -> {self.folder}/ (rank"
                      f"{self.rank}.*.pt.trace.json: Perfetto / chrome://tracing, or "
                      f"tensorboard --logdir {self.folder})")

    def _dump(self, name: str, trainer=None) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.folder / name))
        if trainer is not None:
            trainer.print(f"profile: CUDA memory snapshot -> {self.folder / name} (open it at "
                          "pytorch.org/memory_viz)")

    def _on_oom(self, device, alloc, device_alloc, device_free) -> None:
        self._dump(f"memory_rank{self.rank}_oom.pickle")

    def _write_rss(self, trainer) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = Path(self.folder / f"memory_rank{self.rank}.json")
        path.write_text(json.dumps({
            "device": trainer.device.type,
            "note": "no CUDA memory snapshot on this device: the process's peak RSS (and RSS) "
                    "at the end of each phase",
            "phases": self.rss}, indent=2) + "\n", encoding="utf-8")

    def on_train_end(self, trainer) -> None:
        if self.active and self.profiler is not None:
            self._finish(trainer, trainer.progress.step)  # the window ran past the last step
        if self.active and not self.cuda:
            self._phase("end")
            self._write_rss(trainer)

    def close(self, trainer) -> None:
        if self.profiler is not None:  # training raised inside the window
            self.profiler.stop()
            self.profiler = None
        if self.active and self.cuda and torch.cuda.is_available():
            torch.cuda.memory._record_memory_history(enabled=None)

"""Recipe tables for looking inside a run: ``[run.diagnostics]``, ``[run.routing]`` and
``[run.profile]`` (the hooks that use them: ``diagnostics.py``, ``routing_hook.py``,
``profiling.py``). Kept apart from the hooks so reading a recipe imports none of them."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kiln.components.base import Config


class DiagnosticsConfig(Config):
    """Per-module figures every ``interval`` steps (``[run.diagnostics]``: the table turns them
    on; without it no hook is registered and nothing is computed)."""

    interval: int = Field(100, ge=1, description="collect on every N-th step")
    attention: bool = Field(
        True, description="attention logit max and entropy per layer (recomputes q.k of every "
        "attention layer on a diagnostic step)")
    attention_rows: int = Field(
        64, ge=0, description="query positions per sequence the attention figures read (evenly "
        "spaced, ending at the last; 0 = all T: exact, but the recompute grows with T^2)")
    histograms: bool = Field(
        True, description="TensorBoard histograms of each block's output (a sample of rank 0's "
        "values) beside the scalars")


class RoutingConfig(Config):
    """Routing health of MoE layers (always on for a model with MoE layers; ``[run.routing]``
    tunes it): expert loads and biases to experts.jsonl every log interval, dead experts."""

    dead_below: float = Field(
        0.05, ge=0, description="an expert is dead on a step where its load is below this "
        "multiple of the mean load (1 = balanced)")
    dead_steps: int = Field(
        50, ge=1, description="warn when an expert has been dead this many steps in a row")


class ProfileConfig(Config):
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

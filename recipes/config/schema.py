"""The top-level recipe: its tables, their keys and defaults."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from kiln.checkpointing.config import CheckpointConfig
from kiln.components.base import Config, OptionalSub, Sub, component, default_config
from kiln.parallelisms.config import ParallelismConfig
from kiln.parallelisms.health.check import HealthCheckConfig


class ContextWarmupConfig(Config):
    """The ``[training.context_warmup]`` table."""

    steps: int = Field(0, ge=0, description="steps over which the length grows (0 = off)")
    start: int = Field(256, ge=1, description="sequence length at step 0")
    multiple: int = Field(64, ge=1, description="round lengths up to a multiple of this")


class WandbConfig(Config):
    """Weights & Biases logging (``[run.wandb]``); nothing is sent unless this table is set."""

    project: str = Field(description="W&B project")
    entity: str = Field("", description="W&B team or user (default: yours)")
    name: str = Field("", description="W&B run name (default: run.name)")
    group: str = Field("", description="W&B group")
    tags: list[str] = Field(default_factory=list, description="W&B tags")
    mode: Literal["online", "offline", "disabled"] = Field(
        "online", description="offline: write under the run folder only (`wandb sync` later)"
    )


class RunConfig(Config):
    """Where the run writes and how it reports."""

    name: str = Field("", description="run name; default: the recipe file's stem")
    folder: str = Field("", description="run folder; default: runs/<name>")
    log_interval: int = Field(10, ge=1, description="console / JSONL / TensorBoard every N steps")
    tensorboard: bool = Field(True, description="write TensorBoard scalars under the run folder")
    progress_bar: bool = Field(
        True, description="tqdm progress bar on rank 0, when stdout and stderr are terminals"
    )
    wandb: WandbConfig | None = Field(
        None, description="log to Weights & Biases too: a table with at least project (needs "
        "`pip install wandb`)"
    )
    health_check: HealthCheckConfig = Field(
        default_factory=HealthCheckConfig,
        description="before training: every collective on every process group (results and bus "
        "bandwidth), a matmul on every device, the CUDA peer-to-peer matrix",
    )
    # The built-in hooks' tables. Their configs live with the hooks (recipes/hooks/), found
    # through the registry by type, so reading a recipe imports no hook.
    watchdog: Sub("hook") = component(
        "hook", "watchdog", "a step far slower than usual is a hang: every rank dumps its "
        "stacks to RUN/hang/, the run exits 3 naming the slowest rank")
    diagnostics: OptionalSub("hook") = component(
        "hook", None, "per-module activation, attention, gradient and update figures every "
        "interval steps (a table turns them on; docs/diagnostics.md)", implied="diagnostics")
    routing: Sub("hook") = component(
        "hook", "routing", "MoE routing health: expert loads, dead experts (models with MoE "
        "layers)")
    profile: OptionalSub("hook") = component(
        "hook", None, "torch.profiler over a window of steps, memory snapshots (a table turns "
        "it on)", implied="profile")
    plot_interval: int = Field(
        0, ge=0, description="redraw RUN/plots/*.png every N steps and at the end (0 = off; "
        "needs matplotlib: the plot extra)"
    )

    SLOTS: ClassVar[tuple[str, ...]] = ("watchdog", "diagnostics", "routing", "profile")

    @model_validator(mode="after")
    def _slots(self) -> RunConfig:
        for name in self.SLOTS:
            cfg = getattr(self, name)
            if cfg is not None and cfg.type != name:
                raise ValueError(
                    f"run.{name}.type = {cfg.type!r}: [run.{name}] configures the built-in "
                    f"{name} hook; add other hooks as [hooks.NAME] tables")
        return self


class TrainingConfig(Config):
    """The batch plan, the training budget and the numerics."""

    steps: int = Field(0, ge=0, description="optimizer steps (0 = derive from epochs or tokens)")
    epochs: float = Field(0.0, ge=0, description="budget in data epochs (used when steps = 0)")
    tokens: int = Field(0, ge=0, description="budget in tokens (used when steps = epochs = 0)")
    max_hours: float = Field(
        0.0, ge=0, description="wall-clock budget of this process (one scheduler allocation): "
        "stop at the last step boundary that leaves time for a checkpoint, exit 0; the same "
        "command continues the run (0 = no limit)"
    )
    min_steps: int = Field(
        0, ge=0, description="at least this many steps when the budget comes from epochs or "
        "tokens (ignored when steps is set)"
    )
    global_batch: int = Field(8, ge=1, description="sequences per optimizer step, all ranks")
    micro_batch: int = Field(4, ge=1, description="sequences per forward pass on one rank")
    grad_accum: int = Field(
        0, ge=0, description="micro-batches per step per rank (0 = global_batch/world/micro)"
    )
    seq_len: int = Field(256, ge=1, description="tokens per training sequence")
    seed: int = Field(0, ge=0, lt=2**63,
                      description="seed for init, data order and dropout (0 to 2^63 - 1)")
    grad_clip: float = Field(1.0, ge=0, description="clip the global grad norm (0 = off)")
    mixed_precision: Literal["none", "bf16"] = Field(
        "none", description="autocast dtype for the forward pass"
    )
    device: Literal["auto", "cpu", "cuda", "npu", "xpu", "mps"] = Field(
        "auto", description="auto = the accelerator torch.accelerator reports (cuda, npu with "
        "torch_npu installed, xpu, mps), else cpu; each process takes device LOCAL_RANK",
    )
    threads: int = Field(0, ge=0, description="torch intra-op threads on CPU (0 = torch default)")
    loss_chunk_tokens: int = Field(
        0, ge=0, description="chunked cross-entropy: the LM head and the loss run this many "
        "tokens at a time, so the micro-batch's full logits never exist (0 = unchunked)",
    )
    context_warmup: ContextWarmupConfig = Field(
        default_factory=ContextWarmupConfig,
        description="grow the sequence length from `start` to seq_len over `steps` steps",
    )
    init_check: bool = Field(
        False, description="check with a cheap checksum all-gather that all ranks built the "
        "same initial weights (multi-process runs)",
    )
    step: Sub("step") = component("step", "standard", "how one optimizer step is computed")


class EvalConfig(Config):
    """Periodic evaluation on the held-out split."""

    interval: int = Field(0, ge=0, description="evaluate every N steps (0 = off)")
    tokens: int = Field(65536, ge=1, description="token budget per evaluation (all ranks)")
    at_end: bool = Field(True, description="evaluate after the last step")


class Recipe(Config):
    """A kiln recipe: the components of one training run and their settings."""

    # Top-level tables of which a recipe uses one: a file that writes one of them replaces the
    # others inherited through `extends` (recipes/config/loader.py).
    exclusive_tables: ClassVar[tuple[tuple[str, ...], ...]] = (("optimizer", "optimizers"),)

    description: str = Field("", description="free text shown by `kiln show`")
    run: RunConfig = Field(default_factory=RunConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    model: Sub("model") = component("model", "transformer", "the network")
    tokenizer: Sub("tokenizer") = component("tokenizer", "byte", "text to token ids")
    data: Sub("dataset") = component("dataset", "packed_documents", "training data")
    adapter: OptionalSub("adapter") = component(
        "adapter", None, "trainable adapters on a frozen model (LoRA; docs/finetuning.md)",
        implied="lora",
    )
    optimizer: OptionalSub("optimizer") = component(
        "optimizer", None, "one optimizer for every parameter (or use [optimizers.NAME])",
        implied="adamw",
    )
    optimizers: dict[str, Sub("optimizer")] = Field(
        default_factory=dict, description="several optimizers, each routing its own parameters"
    )
    guards: dict[str, Sub("guard")] = Field(
        default_factory=dict, description="step guards (e.g. loss-spike skipping), by name"
    )
    eval: EvalConfig = Field(default_factory=EvalConfig)
    hooks: dict[str, Sub("hook")] = Field(
        default_factory=dict, description="more hooks around the step, by name: a plugin's "
        "registered hooks (kiln's own are set in [run]; `kiln list hook`)"
    )
    evals: dict[str, Sub("task")] = Field(
        default_factory=dict, description="downstream tasks scored during training and by "
        "`kiln eval --tasks`, by name (docs/evaluation.md)"
    )
    rewards: dict[str, Sub("reward")] = Field(
        default_factory=dict, description="rewards of a reinforcement-learning step (grpo), "
        "by name; each logged on its own (docs/rl.md)"
    )
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @model_validator(mode="after")
    def _budget_needs_checkpoints(self) -> Recipe:
        if self.training.max_hours and not self.checkpoint.enable:
            raise ValueError(
                f"training.max_hours = {self.training.max_hours:g} stops the run early so that "
                "the same command continues it from a checkpoint, but checkpoint.enable = false; "
                "enable checkpoints or set training.max_hours = 0"
            )
        return self

    @model_validator(mode="after")
    def _async_saves_what_it_can_copy(self) -> Recipe:
        if not (self.checkpoint.enable and self.checkpoint.async_save):
            return self
        for name, cfg in self.optimizer_tables().items():
            if cfg.async_save_problem:
                table = "optimizer" if name == "main" and self.optimizer is not None \
                    else f"optimizers.{name}"
                raise ValueError(f"checkpoint.async = true cannot save {table}.type = "
                                 f"{cfg.type!r}: {cfg.async_save_problem}; set "
                                 "checkpoint.async = false (saves then block the step)")
        return self

    @model_validator(mode="after")
    def _one_optimizer_table(self) -> Recipe:
        if self.optimizer is not None and self.optimizers:
            raise ValueError("both [optimizer] and [optimizers.NAME] tables are set; use one")
        if self.optimizer is None and not self.optimizers:
            self.optimizer = default_config("optimizer", "adamw")
        return self

    @model_validator(mode="after")
    def _hooks_not_in_run(self) -> Recipe:
        for name, cfg in self.hooks.items():
            if cfg.type in RunConfig.SLOTS or cfg.type == "plot":
                table = "run.plot_interval" if cfg.type == "plot" else f"[run.{cfg.type}]"
                raise ValueError(f"hooks.{name}.type = {cfg.type!r}: kiln's {cfg.type} hook is "
                                 f"set with {table}; [hooks.NAME] adds a plugin's hook")
        return self

    @model_validator(mode="after")
    def _window_fits_the_sequence(self) -> Recipe:
        window = getattr(getattr(self.model, "attention", None), "window", 0)
        context = getattr(self.model, "max_seq_len", 0) or self.training.seq_len
        if window and window > context:
            where = ("model.max_seq_len" if getattr(self.model, "max_seq_len", 0)
                     else "training.seq_len")
            raise ValueError(f"model.attention.window = {window} is longer than the sequence "
                             f"({where} = {context}): every query would see every earlier "
                             "token; lower the window or set it to 0 (full attention)")
        return self

    def optimizer_tables(self) -> dict[str, Config]:
        """Optimizers by name; a single [optimizer] table is called "main"."""
        return {"main": self.optimizer} if self.optimizer is not None else dict(self.optimizers)

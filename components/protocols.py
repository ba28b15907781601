"""The contracts between the trainer and what it drives, written as code.

- ``StepContext``: what a step receives each step (never the trainer; a test builds its own).
- ``StepContract`` and ``StepBuildContext``: what a step may declare, and what it may ask for
  once before the first step: the policy and frozen models sharded like it (a reference for a
  preference loss, a teacher), which it then holds.
- ``ModelContract``: a model's optional methods, no-op by default (kiln's models inherit them;
  ``complete_model`` gives them to one that does not, once: the trainer calls them directly).
- ``DatasetContract``: what a dataset may offer beyond ``prepare`` and ``loader``, the same way.
- The adapters' contract lives beside it, in ``adapter_contract.py``.
- ``Hook``: the base of every hook, one method per event of ``Trainer.fit``, with a priority.
- ``GuardDecision`` and ``StepResult``: what a guard decides and what a step returns.

A leaf module: it imports only torch, so any floor may use it.
"""

from __future__ import annotations

import types
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn


@dataclass
class GuardDecision:
    """A guard's verdict on one step, or one segment of a step."""

    skip: bool = False
    abort: bool = False
    reason: str = ""


@dataclass
class StepResult:
    """One optimizer step's outcome. ``loss`` is the global mean over the step's tokens."""

    loss: float
    tokens: int  # tokens processed by all ranks in this step
    grad_norm: float | None = None
    skipped: bool = False
    reason: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    # What MFU counts: the tokens the model's passes computed, in forward-and-backward
    # equivalents (a forward without gradients counts a third), all ranks; None = ``tokens``.
    # The trainer sets it from ``token_logprobs``' count (preference, GRPO: padding cut, a
    # shared prompt once, the reference's forward), where it differs from the data's tokens.
    flop_tokens: float | None = None


class StepContext(Protocol):
    """What a step component may use. ``recipes/training/step_context.py`` implements it."""

    model: nn.Module
    device: torch.device
    autocast: AbstractContextManager
    pipeline: Any  # under parallelism.pp: runs the micro-batches through the schedule; else None
    step: int  # optimizer steps taken before this one
    total_steps: int
    tokens_per_step: int  # all ranks; shorter during a context warmup
    token_weighted: bool  # masked data: the loss is the mean over the global trained tokens

    def zero_grad(self) -> None: ...

    def micro_weights(self, micro_batches: list[dict[str, torch.Tensor]]
                      ) -> tuple[list[float], int]:
        """With ``token_weighted``: each micro-batch's loss weight and the trained tokens."""

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token loss of one micro-batch."""

    def token_logprobs(self, batch: dict[str, torch.Tensor], model: nn.Module | None = None,
                       temperature: float = 1.0, vocab: int | None = None,
                       groups: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(log p(label) (B, T) fp32, trained (B, T) bool)`` of one micro-batch through
        ``model`` (the policy by default; a frozen model from ``StepBuildContext``), with this
        rank's inputs; ``temperature`` and ``vocab``: as a sampler sees the logits (divided,
        cut); untrained positions hold 0. For sequence-level losses (preference, RL).
        ``groups`` (G, K) row indices: rows that begin with the same prompt, computed once
        where the model allows it (``attention/shared_prefix.py``); the values are the same."""

    def shared_prefix_problem(self, model: nn.Module | None = None) -> str | None:
        """Why ``model`` (the policy by default) cannot compute a shared prompt once; None:
        it can."""

    def stage_loss(self, run: Any, labels: torch.Tensor,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of ``run(**kw)``: the model's forward, or the last pipeline stage's;
        ``rows``, each row's data source (a mixture's per-source loss)."""

    def grad_sync(self, is_last_microbatch: bool) -> AbstractContextManager:
        """Around each micro-batch's backward: gradients are reduced on the last one only."""

    def sync_grads(self) -> None: ...

    def clip_grads(self) -> torch.Tensor: ...

    def global_stats(self, *, averaged: tuple[str, ...] = ("loss",),
                     **values: torch.Tensor | None) -> dict[str, float]:
        """The values as floats, with one host sync; those named in ``averaged`` are first
        averaged over ranks (each rank's share of a global-batch mean)."""

    def guard_decision(self, stats: dict[str, float], segment: int) -> GuardDecision: ...

    def optimizer_step(self, decision: GuardDecision, stats: dict[str, float], *,
                       segment: int, last_segment: bool) -> None: ...


class StepBuildContext(Protocol):
    """What a step may ask for once, before the first step (``StepContract.setup``).
    ``recipes/training/step_build.py`` implements it; a test may build its own."""

    policy: nn.Module  # the model the step trains, parallelized
    device: torch.device
    dataset: Any  # the run's dataset (a preference dataset's ``pair_batch``)
    run_dir: Any  # the run folder (Path); it may not exist before the first step
    rank: int  # this process's data-parallel rank, of ``ranks``; ``is_main`` writes files
    ranks: int
    is_main: bool

    def token_logprobs(self, batch: dict[str, torch.Tensor], model: nn.Module | None = None,
                       temperature: float = 1.0, vocab: int | None = None,
                       groups: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``StepContext.token_logprobs`` of a batch (to the device), before the first step."""

    def shared_prefix_problem(self) -> str | None:
        """``StepContext.shared_prefix_problem`` of the policy (for the start-up log)."""

    def without_adapters(self) -> AbstractContextManager | None:
        """With ``[adapter]``: a context within which the policy computes its frozen base (the
        reference of a preference loss, no second copy of the weights); else None."""

    def frozen_model(self, source: str = "initial") -> nn.Module:
        """A frozen model (eval mode) built and sharded as the policy is: ``"initial"``, the
        policy's starting weights without adapters (``init_from``, else its seeded start; the
        same after a resume), the reference of a preference loss or KL term; else what
        ``init_from`` may name (a teacher). Call it in ``setup`` and keep the model."""


class StepContract:
    """The optional part of the step contract (docs/design.md "Steps"; a step is called
    ``step(ctx, micro_batches) -> StepResult``); ``complete_step`` completes a plugin step."""

    token_weighted: bool = False  # can weight micro-batches by their trained tokens (chat data)
    takes_pairs: str = ""  # "paired" / "unpaired" (preference data), "prompts" (RL)
    varying_width: bool = False  # trims or packs its rows: a micro-batch's token count varies
    # its loss includes the model's multi-token prediction losses (``ctx.forward_loss`` does;
    # steps that score ``ctx.token_logprobs`` leave the MTP modules as they are, and say so)
    trains_mtp: bool = True
    # values of ``evaluate`` that are per-example scores ("rewards/accuracies"): each gets its
    # standard error, example count and fingerprint, so `kiln compare` judges it like a task
    scores: tuple[str, ...] = ()

    def check_recipe(self, recipe: Any, layout: Any) -> None:
        """Refuse a recipe this step cannot train (a RecipeError naming the key), for ``train``
        and ``validate`` alike; ``layout``: the run's mesh (``tp``, ``cp``, ``pp``, ``dp``)."""

    def check_data(self, dataset: Any) -> None:
        """Refuse data this step cannot train (a DataError), once it is prepared."""

    def setup(self, build: StepBuildContext) -> None:
        """Once, after the policy is built and parallelized, before the first step (also on a
        resume): take what the step holds besides the policy (``build.frozen_model()``)."""

    def evaluate(self, ctx: StepContext, batch: dict[str, torch.Tensor]
                 ) -> dict[str, torch.Tensor]:
        """Per example of a held-out micro-batch (no gradients), the step's own values (1-D),
        logged averaged as ``eval/NAME`` at each evaluation; ``{}``: the held-out loss alone."""
        return {}


def complete_step(step: Any) -> Any:
    """Give a step that does not inherit ``StepContract`` its defaults; return it."""
    if not isinstance(step, StepContract):
        _complete(step, StepContract)
        for name in ("token_weighted", "takes_pairs", "varying_width", "trains_mtp", "scores"):
            if not hasattr(step, name):
                object.__setattr__(step, name, getattr(StepContract, name))
    return step


class ModelContract:
    """The optional part of the model contract (docs/design.md "Model protocol").

    Every method here is a no-op by default. A model overrides what it needs: MoE models their
    auxiliary loss and bias updates, looped models their carry.
    """

    def pop_aux_loss(self) -> torch.Tensor | None:
        """Auxiliary losses of the last forward. The trainer adds their gradient, not value."""
        return None

    def on_optimizer_step(self, skipped: bool) -> None:
        """After every optimizer step decision; a segmented step makes several per step."""

    def on_global_step(self, skipped: bool) -> None:
        """Once per global step, after the step returns."""

    def set_progress(self, step: int, total_steps: int) -> None:
        """Before every step: schedules inside the model."""

    def metrics(self) -> dict[str, float]:
        """Logged every log interval, e.g. expert loads."""
        return {}

    def carry_state(self) -> dict[str, torch.Tensor] | None:
        """Latent state carried across steps, saved in the checkpoint payload."""
        return None

    def load_carry_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what ``carry_state`` returned."""

    def resolve_kernels(self, device: torch.device, dtype: torch.dtype,
                        compiling: bool = False) -> str:
        """Pick kernels once the device and dtype are known (``compiling``: the blocks run
        under ``torch.compile``); a line for the log, or ""."""
        return ""

    def param_summary(self) -> dict[str, int]:
        """Parameter counts by part, printed by ``kiln validate``."""
        return {}

    def lr_multipliers(self) -> dict[str, float]:
        """Per-parameter factors on an AdamW-family optimizer's LR, by parameter name (µP's
        hidden matrices: 1 / width multiplier); parameters not named keep the optimizer's LR."""
        return {}

    def width_multiplier(self) -> float:
        """µP's width / base width (1 under the standard parametrization)."""
        return 1.0


class DatasetContract:
    """The optional part of the dataset contract (docs/design.md "Dataset protocol"): what a
    dataset may offer the trainer beyond ``prepare()`` and ``loader(split, ...)``.

    Each member has a no-op default. kiln's datasets inherit it; ``complete_dataset`` gives a
    plugin dataset the members it lacks, once, when it is built, so the trainer, the hooks and
    ``kiln validate`` read them directly.
    """

    token_weighted: bool = False  # masked labels: the loss is the mean over trained tokens
    # one example per row, then padding: a step may run a micro-batch only as wide as its
    # longest example (``step_context.padding_cut``)
    padded_rows: bool = False
    pairs: str = ""  # "paired": chosen rows, then rejected; "unpaired" (KTO); "prompts" (RL)
    template: Any = None  # chat data: the template it renders with (the run folder keeps it)
    source_names: Any = ()  # a mixture's sources, in the order of a batch's source_ids
    meta: Any = types.MappingProxyType({})  # the prepared data's metadata

    def check_run(self, total_steps: int, global_batch: int) -> list[str]:
        """Before step 1, with the run's length: a DataError, or lines for the log."""
        return []

    def describe(self) -> str:
        """One line about the prepared data for the start-up log ("" = none)."""
        return ""

    def tokens_per_byte(self, split: str = "eval", source: str | None = None) -> float | None:
        """Tokens per UTF-8 byte of ``split`` (bits per byte); None when not known."""
        return None

    def fingerprints(self) -> dict[str, str]:
        """What the data is, by recipe key (``data``, ``data.sources.NAME``): saved with every
        checkpoint, a resume on other data is refused."""
        return {}

    def eval_fingerprints(self) -> dict[str, str]:
        """What the held-out split is, by recipe key: equal for two runs scored on the same
        examples in the same order (``kiln compare`` judges only those against each other).
        Default: ``fingerprints()``; a dataset whose train order follows training.seed but
        whose held-out split does not says so here."""
        return self.fingerprints()

    def stage_steps(self) -> list[int | None]:
        """Where each stage begins in this run (a mixture's ``data.stages``)."""
        return []

    def pin_stages(self, saved: list[int | None], resume_step: int,
                   total_steps: int) -> list[str]:
        """On a resume with another run length: keep the stages that began (log lines)."""
        return []


def complete_dataset(dataset: Any) -> Any:
    """Give ``dataset`` every member of ``DatasetContract`` it lacks (methods and attributes);
    return it. For a plugin dataset that does not inherit the contract."""
    if isinstance(dataset, DatasetContract):
        return dataset
    _complete(dataset, DatasetContract)
    for name in ("token_weighted", "padded_rows", "pairs", "template", "source_names",
                 "meta"):
        if not hasattr(dataset, name):
            object.__setattr__(dataset, name, getattr(DatasetContract, name))
    return dataset


def _complete(obj: Any, base: type) -> Any:
    """Give ``obj`` the default of every public method of ``base`` it lacks; return it."""
    for name, default in vars(base).items():
        if callable(default) and not name.startswith("_") and not hasattr(obj, name):
            object.__setattr__(obj, name, types.MethodType(default, obj))
    return obj


def complete_model(model: nn.Module) -> nn.Module:
    """Give ``model`` the no-op default of every optional method it lacks; return it.

    For a plugin model that does not inherit ``ModelContract``. The check runs once, when the
    model is built, so the trainer and steps call the methods without probing.
    """
    return _complete(model, ModelContract)


class Hook:
    """Work around the step. Override the events you need; every default does nothing.

    The trainer runs its hooks in ``priority`` order, highest first, for every event, and keeps
    the listed order among equal priorities; ``close`` runs in the reverse order. The events
    below are listed in the order ``fit`` calls them. An object passed as a hook without
    deriving from ``Hook`` gets the missing events and priority 0 (``complete_hook``).
    """

    priority: int = 0

    def on_train_start(self, trainer) -> None:
        """Once, before the first step; the run may have resumed already."""

    def on_step_start(self, trainer) -> None:
        """Before each step, before its batches are read."""

    def on_first_step(self, trainer) -> None:
        """Once, after the first step of this process: the run folder exists from here on."""

    def on_step_end(self, trainer, result: StepResult) -> None:
        """After each step, with its result."""

    def on_train_end(self, trainer) -> None:
        """Once, after the last step, unless training raised."""

    def close(self, trainer) -> None:
        """Always called last, also when training raised: release what the hook holds."""



def complete_hook(hook: Any) -> Hook:
    """Give a hook that does not derive from ``Hook`` the events it lacks, and priority 0."""
    if not isinstance(hook, Hook):
        _complete(hook, Hook)
        if not hasattr(hook, "priority"):
            object.__setattr__(hook, "priority", 0)
    return hook

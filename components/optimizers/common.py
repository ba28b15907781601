"""What every optimizer config shares: peak LR, weight decay, parameter routing and schedule."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from kiln.components.base import ComponentConfig, Config, Sub, component
from kiln.components.errors import RecipeError
from kiln.components.optimizers.memory import optimizer_state_bytes  # noqa: F401  (kiln bench)


class ParamRule(Config):
    """Selects parameters by dimensionality, name pattern and owning module type.

    A parameter matches when every non-empty criterion matches: ``ndim`` contains its number of
    dimensions, a pattern of ``include`` matches its name (fnmatch), no pattern of ``exclude``
    does, ``modules`` contains the class name of the module that owns it and ``exclude_modules``
    does not. A class matches its subclasses too (``Linear`` matches torchao's ``Float8Linear``
    and FSDP2's ``FSDPLinear``). ``rest`` matches whatever no other optimizer's rule selected.
    """

    ndim: list[int] = Field(default_factory=list, description="accepted ndims (empty = any)")
    include: list[str] = Field(
        default_factory=list, description="fnmatch patterns on parameter names (empty = any)"
    )
    exclude: list[str] = Field(default_factory=list, description="fnmatch patterns to leave out")
    modules: list[str] = Field(
        default_factory=list, description="owning module class names, e.g. Embedding (empty = any)"
    )
    exclude_modules: list[str] = Field(
        default_factory=list, description="owning module class names to leave out, e.g. Embedding"
    )
    rest: bool = Field(False, description="take every parameter no other optimizer selected")


class OptimizerConfig(ComponentConfig):
    """Base of optimizer configs. Registered optimizers are built as ``obj(cfg, groups)``,
    ``groups`` being torch param-group dicts (``params``, ``lr``, ``weight_decay``, ``name``)."""

    lr: float = Field(3e-4, ge=0, description="peak learning rate (the schedule scales it)")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    params: ParamRule = Field(
        default_factory=lambda: ParamRule(rest=True),
        description="which parameters this optimizer trains",
    )
    no_decay: list[ParamRule] = Field(
        default_factory=lambda: [ParamRule(ndim=[1]), ParamRule(modules=["Embedding"])],
        description="rules (any may match) for parameters exempt from weight decay; default: "
        "1-D (norms, biases) and embeddings; [] decays everything",
    )
    schedule: Sub("schedule") = component("schedule", "warmup_cosine", "LR schedule")
    step_every: Literal["segment", "global"] = Field(
        "segment",
        description="with segmented steps: step after every segment, or on the last one only",
    )

    # How µP's per-parameter LR factors (the model's ``lr_multipliers``) apply: "scale" for
    # updates normalised entry by entry (AdamW family, sign SGD: Tensor Programs V, Table 3),
    # "own" where the optimizer keeps its LR width-independent itself (Muon's spectral
    # scaling), "refuse" where kiln has no µP rule (plain SGD).
    mup_rule: ClassVar[str] = "scale"
    # Why ``checkpoint.async = true`` cannot save this optimizer's state ("" where it can):
    # DCP's async staging copies every state tensor, which a tensor subclass may not implement.
    async_save_problem: ClassVar[str] = ""

    def check_mup(self, table: str) -> None:
        """Raise a RecipeError when this optimizer cannot train a µP model as configured."""
        if self.mup_rule == "refuse":
            raise RecipeError(f"optimizer {table!r} ({self.type}): no µP learning-rate rule "
                              "for this optimizer; use adamw (or another AdamW-family "
                              "optimizer) or muon, or model.parametrization = \"standard\"")

    @model_validator(mode="after")
    def _decay_keeps_the_sign(self) -> OptimizerConfig:
        """Weight decay multiplies the weights by 1 - lr * weight_decay a step: at 1 or more it
        zeroes or flips them, and the run went NaN at step 2 with a message blaming the LR."""
        if self.lr * self.weight_decay >= 1:
            raise ValueError(
                f"lr * weight_decay = {self.lr:g} * {self.weight_decay:g} >= 1: each step "
                "multiplies the weights by 1 - lr * weight_decay, which would zero or flip "
                "them; lower lr or weight_decay (usually 0.01 to 0.1)")
        return self

    @field_validator("no_decay", mode="before")
    @classmethod
    def _one_rule_is_a_list(cls, value: Any) -> Any:
        """``no_decay = { ndim = [1] }`` (one table) means a list of that one rule."""
        return [value] if isinstance(value, (dict, ParamRule)) else value


class AdamFamilyConfig(OptimizerConfig):
    """The Adam family's moment decays, checked with the recipe: torch's own check raised a bare
    ValueError when the optimizer was built, after ``kiln validate`` had passed."""

    betas: list[float] = Field(
        default_factory=lambda: [0.9, 0.95], min_length=2, max_length=2,
        description="[beta1, beta2], each in [0, 1)",
    )

    @field_validator("betas")
    @classmethod
    def _decays(cls, betas: list[float]) -> list[float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"each beta must lie in [0, 1), got {betas}")
        return betas

"""What a step may ask for before the first step (``protocols.StepBuildContext``): the policy,
and frozen models built and sharded as the policy is (a reference for a preference loss or a KL
term, a teacher). The step takes them in ``setup`` and holds them; the trainer stays one loop.

A frozen model is a second build of the recipe's model (without adapters) through the same
``parallelize`` call, so its parameters have the policy's placements and a rank holds its own
shard of both. ``"initial"`` gives the policy's starting weights: ``checkpoint.init_from`` when
the run names one, else a copy of the policy's weights taken before any resume (its seeded
initialisation), so a resumed run gets the same reference.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path

import torch
from torch import nn

from kiln.components.errors import RecipeError
from kiln.components.protocols import StepBuildContext


class StepBuild(StepBuildContext):
    """The trainer's ``StepBuildContext``: call it before the run resumes."""

    def __init__(self, trainer) -> None:
        self._trainer = trainer
        self.policy: nn.Module = trainer.model
        self.device: torch.device = trainer.device
        self.dataset = trainer.dataset
        self.run_dir: Path = trainer.run_dir
        self.rank, self.ranks = trainer.data_rank, trainer.data_ranks
        self.is_main: bool = trainer.world.is_main
        self.lines: list[str] = []  # for the start-up log

    def token_logprobs(self, batch: dict[str, torch.Tensor], model: nn.Module | None = None,
                       temperature: float = 1.0, vocab: int | None = None,
                       groups: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._trainer.step_context.token_logprobs(self._trainer.to_device(batch), model,
                                                         temperature, vocab, groups)

    def shared_prefix_problem(self) -> str | None:
        return self._trainer.step_context.shared_prefix_problem()

    def without_adapters(self) -> AbstractContextManager | None:
        adapter = self._trainer.adapter
        if adapter is None:
            return None
        self.lines.append("step: the reference is the policy with its adapters switched off "
                          "(no second copy)")
        return adapter.disabled(self.policy)

    def frozen_model(self, source: str = "initial") -> nn.Module:
        from kiln.parallelisms import materialize, parallelize
        from kiln.parallelisms.fsdp import reshard_after_every_forward
        from kiln.recipes.loading.weights import Source

        t = self._trainer
        recipe, pcfg = t.recipe, t.recipe.parallelism
        if t.parallel.pipeline is not None:
            raise RecipeError("training.step: a frozen model (reference, teacher) is not "
                              "supported with parallelism.pp > 1 yet; train without pipeline "
                              "parallelism")
        model = t.build_model()
        for p in model.parameters():  # before FSDP2 wraps them: no gradient is ever reduced
            p.requires_grad_(False)
        # No backward comes: no resharding for one, and no fp8 weight gradient whose token
        # dimension would need padding (the forward's inner dimensions pass the layer filter).
        pcfg = pcfg.model_copy(update={"reshard_after_forward": "always",
                                       "float8_pad_inner_dim": "off"})
        plan = parallelize(
            model, pcfg, t.world, mesh=t.health.mesh, ep_mesh=t.health.ep_mesh,
            training=recipe.training, grad_accum=t.plan.grad_accum, checkpoint=recipe.checkpoint,
            attention=getattr(recipe.model, "attention", None))
        if pcfg.meta_init:
            materialize(model, t.device, recipe.training.seed, mode=pcfg.init_mode,
                        replica_max_params=pcfg.replica_init_max_params, pipeline=plan.pipeline)
        spec = recipe.checkpoint.init_from if source == "initial" else source
        if spec:
            opened = Source.open(recipe, is_main=t.world.is_main, spec=spec)
            n = opened.load(model)
            what = f"{spec} ({n} tensors)"
            # saved with every checkpoint: a resume must find the same weights (check_frozen)
            t.frozen_record = {**(t.frozen_record or {}), source: opened.base_record()}
        else:
            _copy_weights(self.policy, model)
            what = "the policy's initial weights"
        reshard_after_every_forward(model)
        model.eval()
        self.lines.append(f"step: a frozen model from {what}, sharded as the policy")
        return model


@torch.no_grad()
def _copy_weights(policy: nn.Module, frozen: nn.Module) -> None:
    """Every parameter and buffer of ``frozen`` from the policy's of the same name (the same
    placements: each rank copies its own shard); the policy's adapters have no counterpart."""
    have = dict(policy.named_parameters())
    have.update(policy.named_buffers())
    for name, t in [*frozen.named_parameters(), *frozen.named_buffers()]:
        if name not in have:
            raise RecipeError(f"training.step: the frozen model's {name} has no counterpart in "
                              "the policy; it cannot start from the policy's weights")
        t.copy_(have[name])


def check_frozen(resumed: Path, records: dict | None) -> list[str]:
    """A resumed run's frozen models read from a source (``checkpoint.init_from`` for the
    reference, a teacher's folder) against those its checkpoint was trained with: other weights
    are refused (a DPO or GRPO run would go on against another reference); the same weights at
    another place give a line for the log. ``records`` (``Trainer.frozen_record``) and the
    checkpoint's ``frozen`` map a source (``"initial"``, a spec) to its ``base_record``."""
    from kiln.checkpointing.load_checks import read_state
    from kiln.components.errors import CheckpointError
    from kiln.recipes.loading.weights import place

    saved = read_state(Path(resumed)).get("frozen")
    if not records or not isinstance(saved, dict):  # (saved before frozen models were recorded)
        return []
    lines = []
    for source, record in records.items():
        old = saved.get(source)
        if not isinstance(old, dict) or not isinstance(old.get("fingerprint"), str):
            continue
        what = ("the step's frozen reference, checkpoint.init_from" if source == "initial"
                else f"the step's frozen model from {source!r}")
        if old["fingerprint"] != record["fingerprint"]:
            raise CheckpointError(
                f"{resumed}: {what} = {record['init_from']!r} holds other weights than the run "
                f"was trained against ({old.get('init_from')!r}, weights fingerprint "
                f"{old['fingerprint'][:12]}; now {record['fingerprint'][:12]}), and the run "
                "would go on against another model; restore those weights there (or name "
                "where they are now), or continue from this checkpoint's weights against the "
                "new ones with checkpoint.weights_only = true (a fresh schedule, optimizer and "
                "data stream)")
        if place(str(old.get("init_from", ""))) != place(record["init_from"]):
            lines.append(f"kiln: {what} moved: {old.get('init_from')!r} is now "
                         f"{record['init_from']!r}, with the same weights")
    return lines

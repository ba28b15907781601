"""A step that holds a frozen reference model, written in this one file through the step
contract (``StepContract.setup`` and ``StepBuildContext.frozen_model``), as a preference or
RL step will be: cross-entropy plus a penalty on the policy's drift from the reference in
log-probability of the labels. The trainer is unchanged; the reference starts at the policy's
weights (its seeded initialisation, or ``init_from`` without the adapters), stays frozen, and
is the same after a resume."""

from __future__ import annotations

import io
from typing import Literal

import pytest
import torch

from kiln.components import registry
from kiln.components.base import ComponentConfig
from kiln.components.protocols import Hook, StepContract, StepResult
from kiln.recipes.config.files import load_recipe
from kiln.recipes.training.trainer import Trainer
from tests.conftest import CONFIGS

TOY = "toy_drift_penalty"


class DriftPenaltyConfig(ComponentConfig):
    beta: float = 1.0
    reference: Literal["copy", "adapters_off"] = "copy"


class DriftPenalty(StepContract):
    """``CE + beta * mean((log p_policy(y) - log p_ref(y))^2)`` over the trained tokens."""

    Config = DriftPenaltyConfig
    token_weighted = False

    def __init__(self, cfg: DriftPenaltyConfig) -> None:
        self.cfg = cfg
        self.reference = None

    def setup(self, build) -> None:
        if self.cfg.reference == "copy":
            self.reference = build.frozen_model()
        else:
            self.adapters_off = build.without_adapters()
            assert self.adapters_off is not None, "adapters_off needs an [adapter]"

    def reference_logprobs(self, ctx, batch):
        with torch.no_grad():
            if self.reference is not None:
                return ctx.token_logprobs(batch, self.reference)[0]
            with self.adapters_off:  # the policy itself, its adapters switched off
                return ctx.token_logprobs(batch)[0]

    def __call__(self, ctx, micro_batches):
        ctx.zero_grad()
        n = len(micro_batches)
        ce_total = torch.zeros((), device=ctx.device)
        drift_total = torch.zeros((), device=ctx.device)
        for i, batch in enumerate(micro_batches):
            with ctx.grad_sync(i == n - 1):
                ce = ctx.forward_loss(batch)
                mine, trained = ctx.token_logprobs(batch)
                ref = self.reference_logprobs(ctx, batch)
                drift = ((mine - ref) ** 2 * trained).sum() / trained.sum()
                ((ce + self.cfg.beta * drift) / n).backward()
            ce_total += ce.detach() / n
            drift_total += drift.detach() / n
        ctx.sync_grads()
        grad_norm = ctx.clip_grads()
        stats = ctx.global_stats(loss=ce_total, grad_norm=grad_norm, drift=drift_total)
        decision = ctx.guard_decision(stats, segment=0)
        ctx.optimizer_step(decision, stats, segment=0, last_segment=True)
        return StepResult(loss=stats["loss"], tokens=ctx.tokens_per_step,
                          grad_norm=stats["grad_norm"], skipped=decision.skip,
                          metrics={"drift": stats["drift"]})


@pytest.fixture(autouse=True)
def toy_step():
    """Registered for these tests only (the combination matrix trains every registered step)."""
    registry.register("step", TOY)(DriftPenalty)
    yield
    registry.unregister("step", TOY)


class Drift(Hook):
    def __init__(self):
        self.drift: dict[int, float] = {}
        self.loss: dict[int, float] = {}

    def on_step_end(self, trainer, result):
        self.drift[trainer.progress.step] = result.metrics["drift"]
        self.loss[trainer.progress.step] = result.loss


TINY = ["--model.dim=32", "--model.n_layers=2", "--model.attention.n_heads=2",
        "--model.ffn.hidden_dim=48", "--training.seq_len=32", "--training.global_batch=4",
        "--training.micro_batch=2", "--data.max_bytes=200000", "--run.progress_bar=false",
        "--run.tensorboard=false", "--eval.interval=0", "--eval.at_end=false",
        "--run.log_interval=1", "--optimizer.lr=1e-2", "--checkpoint.interval=2",
        f"--training.step.type={TOY}"]


def _run(folder, steps=4, extra=()):
    recipe = load_recipe(CONFIGS / "debug.toml", [*TINY, f"--training.steps={steps}",
                                                  f"--run.folder={folder}", *extra])
    drift = Drift()
    trainer = Trainer(recipe, hooks=[drift], out=io.StringIO())
    reference = {n: p.detach().clone() for n, p in trainer.step_fn.reference.named_parameters()}
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    return drift, trainer, reference, start


def test_the_reference_starts_at_the_policy_and_stays_frozen(tmp_path):
    drift, trainer, reference, start = _run(tmp_path / "run")
    ref_model = trainer.step_fn.reference
    assert ref_model is not trainer.model and not ref_model.training
    assert reference.keys() == start.keys()
    assert all(torch.equal(reference[n], start[n]) for n in start)  # the initial weights
    assert drift.drift[1] == 0.0 and drift.drift[4] > 0  # the policy moves away from it
    for name, p in ref_model.named_parameters():
        assert not p.requires_grad and torch.equal(p, reference[name]), name
    held = {id(p) for opt in trainer.optimizers.optimizers.values()
            for g in opt.param_groups for p in g["params"]}
    assert not held & {id(p) for p in ref_model.parameters()}


def test_a_resumed_run_gets_the_same_reference(tmp_path):
    whole, *_ = _run(tmp_path / "whole")
    _run(tmp_path / "cut", steps=2)
    second, trainer, reference, _ = _run(tmp_path / "cut")
    assert trainer.progress.step == 4 and set(second.drift) == {3, 4}
    assert {s: second.drift[s] for s in (3, 4)} == {s: whole.drift[s] for s in (3, 4)}
    assert {s: second.loss[s] for s in (3, 4)} == {s: whole.loss[s] for s in (3, 4)}


def test_with_init_from_and_adapters_the_reference_is_the_base_without_them(tmp_path):
    from kiln.components.models.block import padded_vocab
    from kiln.recipes.inference.saved_model import export_checkpoint
    from tests.components.adapters.test_lora import _save

    base = load_recipe(CONFIGS / "debug.toml", TINY)
    torch.manual_seed(7)
    model = base.model.build(vocab_size=padded_vocab(base.model, 258), seq_len=32)
    export_checkpoint(_save(tmp_path / "base", model, base), tmp_path / "hf")
    drift, trainer, reference, _ = _run(tmp_path / "lora", extra=[
        f"--checkpoint.init_from={tmp_path / 'hf'}", "--adapter.rank=2"])
    assert not any("lora" in n for n in reference)
    for name, p in model.named_parameters():
        assert torch.equal(reference[name], p.detach()), name  # init_from's, not the seed's
    assert drift.drift[1] == 0.0 and drift.drift[4] > 0  # B = 0: the policy starts as the base


def test_with_adapters_the_policy_switched_off_is_the_same_reference_with_no_copy(tmp_path):
    """The reference as the policy with its LoRA adapters off equals a frozen copy of the base:
    the same losses, bit for bit, and no second model."""
    from kiln.components.models.block import padded_vocab
    from kiln.recipes.inference.saved_model import export_checkpoint
    from tests.components.adapters.test_lora import _save

    base = load_recipe(CONFIGS / "debug.toml", [*TINY, "--model.tie_embeddings=false"])
    torch.manual_seed(7)
    model = base.model.build(vocab_size=padded_vocab(base.model, 258), seq_len=32)
    export_checkpoint(_save(tmp_path / "base", model, base), tmp_path / "hf")
    lora = [f"--checkpoint.init_from={tmp_path / 'hf'}", "--adapter.rank=2",
            '--adapter.targets=["*.attention.wq", "output"]', "--model.tie_embeddings=false"]
    copy, *_ = _run(tmp_path / "copy", extra=lora)
    recipe = load_recipe(CONFIGS / "debug.toml", [
        *TINY, "--training.steps=4", f"--run.folder={tmp_path / 'off'}", *lora,
        "--training.step.reference=adapters_off"])
    drift = Drift()
    trainer = Trainer(recipe, hooks=[drift], out=io.StringIO())
    assert trainer.step_fn.reference is None  # no second model
    trainer.fit()
    assert drift.drift == copy.drift and drift.loss == copy.loss
    assert drift.drift[1] == 0.0 and drift.drift[4] > 0


def _worker(rank: int, port: int, folder: str) -> None:
    import json
    import sys

    from kiln.components import distributed
    from tests.parallelisms.tiny import rank_env

    rank_env(rank, 2, port)
    registry.register("step", TOY)(DriftPenalty)
    out: dict = {}
    try:
        drift, trainer, _, _ = _run(f"{folder}/two", extra=["--parallelism.fsdp=on"])
        policy = dict(trainer.model.named_parameters())
        placed = {n: (type(p).__name__, str(getattr(p, "placements", None)))
                  for n, p in trainer.step_fn.reference.named_parameters()}
        out = {"drift": drift.drift, "loss": drift.loss, "dtensors": sum(
            kind == "DTensor" for kind, _ in placed.values()), "placements": sorted(
            {placed[n] == (type(policy[n]).__name__, str(getattr(policy[n], "placements", None)))
             for n in placed})}
    finally:
        with open(f"{folder}/rank{rank}.json", "w") as f:
            json.dump(out, f)
        distributed.shutdown(together=sys.exc_info()[0] is None)


@pytest.mark.slow
def test_under_fsdp2_the_reference_is_sharded_as_the_policy(tmp_path):
    import json

    from tests import forked
    from tests.parallelisms.tiny import free_port

    one, *_ = _run(tmp_path / "one")
    forked.spawn(_worker, args=(free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["placements"] == [True]  # every parameter placed as the policy's
    assert ranks[0]["dtensors"] > 0
    assert ranks[0]["loss"] == ranks[1]["loss"]
    assert [ranks[0]["loss"][str(s)] for s in range(1, 5)] == pytest.approx(
        [one.loss[s] for s in range(1, 5)], rel=1e-5)
    # (the drift is each rank's own micro-batch's: their mean is the one process's)
    assert [(ranks[0]["drift"][str(s)] + ranks[1]["drift"][str(s)]) / 2
            for s in range(1, 5)] == pytest.approx([one.drift[s] for s in range(1, 5)],
                                                   rel=1e-4, abs=1e-9)


def test_a_resume_refuses_a_reference_whose_weights_changed(tmp_path):
    """The reference is read from init_from again on resume: other weights there (a rewritten
    export, another folder) would be another objective, without a word. Refused; the same
    weights moved give a line; weights_only takes the new ones on purpose."""
    import shutil

    from kiln.components.errors import CheckpointError
    from kiln.components.models.block import padded_vocab
    from kiln.recipes.inference.saved_model import export_checkpoint
    from tests.components.adapters.test_lora import _save

    base = load_recipe(CONFIGS / "debug.toml", TINY)
    for seed, name in ((7, "hf"), (8, "other")):
        torch.manual_seed(seed)
        model = base.model.build(vocab_size=padded_vocab(base.model, 258), seq_len=32)
        export_checkpoint(_save(tmp_path / f"base{seed}", model, base), tmp_path / name)
    shutil.copytree(tmp_path / "hf", tmp_path / "moved")
    _run(tmp_path / "run", steps=2, extra=[f"--checkpoint.init_from={tmp_path / 'hf'}"])

    def resume(source: str, *extra: str):
        recipe = load_recipe(CONFIGS / "debug.toml", [
            *TINY, "--training.steps=3", f"--run.folder={tmp_path / 'run'}",
            f"--checkpoint.init_from={tmp_path / source}", *extra])
        trainer = Trainer(recipe, out=io.StringIO())
        trainer.fit()
        return trainer.out.getvalue()

    with pytest.raises(CheckpointError, match="frozen reference, checkpoint.init_from = .*other"
                                              "' holds other weights than the run was trained"):
        resume("other")
    out = resume("moved")
    assert "the step's frozen reference, checkpoint.init_from moved:" in out
    assert "resumed from" in out
    out = resume("other", "--training.steps=4", "--checkpoint.weights_only=true")
    assert "holds other weights" not in out

"""The trainer: builds a run from a resolved recipe and loops over steps; hooks do the rest.

The loop (``fit``) is short on purpose: the step component computes one optimizer step, and
logging, evaluation, checkpointing and profiling hang off hooks (``recipes/hooks.py``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kiln.checkpointing.rng import seed_step
from kiln.components import distributed
from kiln.components.errors import RecipeError, TrainingAborted
from kiln.components.models.lm_head import LossHead, chunk_loss_sum
from kiln.components.steps.common import GuardDecision, unguarded
from kiln.parallelisms.health import run_health_check
from kiln.parallelisms.layout_check import chunked_loss_note, raise_problems, training_problems
from kiln.parallelisms.mesh import layout
from kiln.recipes import batch_plan
from kiln.recipes.context_warmup import context_length, truncate
from kiln.recipes.flops import trainer_peak
from kiln.recipes.hook_list import checkpoint_hook, standard_hooks, start_order
from kiln.recipes.hooks import Hook, eval_loader
from kiln.recipes.metrics import MetricsWriter
from kiln.recipes.model_inputs import ModelInputs
from kiln.recipes.optimizer_set import OptimizerSet
from kiln.recipes.process_stats import Phases
from kiln.recipes.recipe import render_recipe, to_dict, write_text_atomic
from kiln.recipes.run_layout import run_layout
from kiln.recipes.schema import Recipe
from kiln.recipes.watchdog import Watchdog


@dataclass
class Progress:
    """How far training got: optimizer steps taken and tokens consumed (all ranks)."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, d: dict) -> None:
        self.step, self.tokens = int(d["step"]), int(d["tokens"])


class Trainer:
    cross_entropy = staticmethod(F.cross_entropy)  # _parallelize may compile it (compile_loss)
    chunk_loss = staticmethod(chunk_loss_sum)  # per chunk of training.loss_chunk_tokens; likewise

    def __init__(self, recipe: Recipe, *, hooks: list[Hook] | None = None,
                 checkpoints: bool = True, out=None):
        self.recipe = recipe
        self.out = out or sys.stdout
        tr = recipe.training
        self.startup_s: dict[str, float] = {}  # seconds per start-up phase (`kiln bench`)
        self.startup_rss: dict[str, int] = {}  # peak RSS after each phase ([run.profile])
        phase = Phases(self.startup_s, self.startup_rss)
        pcfg = recipe.parallelism
        self.world = distributed.init(tr.device, pcfg.backend, timeout_s=pcfg.collective_timeout_s,
                                      flight_recorder=pcfg.flight_recorder)
        self.device = self.world.device
        if tr.threads and self.device.type == "cpu":
            torch.set_num_threads(tr.threads)
        # The run folder gets its recipe.toml when the first step is done (``fit``): a run that
        # fails before that leaves no folder behind, nor changes an earlier run's.
        self.run_dir = Path(recipe.run.folder)
        self.recipe_toml = render_recipe(recipe)  # also written into every checkpoint
        # This rank's share of each global batch: context- and tensor-parallel peers train on the
        # same batch, so data is split over the data-parallel ranks only (rank // (cp x tp)).
        # Rows [data_rank * per_rank, ...) of each global batch are this rank's; checkpoints map
        # the per-row state (carry) and the data cursor by these rows on a layout change.
        self.mesh_layout = layout(recipe.parallelism, self.world.world_size)
        self.data_rank = self.mesh_layout.dp_rank(self.world.rank)
        self.data_ranks = self.mesh_layout.dp
        shape = self.mesh_layout
        raise_problems(training_problems(tr, shape.tp, shape.cp), shape.describe())
        self.plan = batch_plan.plan(tr, self.data_ranks, tp=shape.tp, cp=shape.cp)
        self.progress = Progress()
        self.seq_len = tr.seq_len  # of the current step (see training.context_warmup)
        self.last_eval_loss: float | None = None
        self.stop_requested = False
        self.data_wait_s = 0.0  # time the loop spent waiting for input batches, in total

        torch.manual_seed(tr.seed)
        phase("process group, run folder")
        self.health = run_health_check(recipe.run.health_check, pcfg, self.world, self.print)
        phase("health check")
        self.tokenizer = recipe.tokenizer.build()
        self.dataset = recipe.data.build(tokenizer=self.tokenizer, seq_len=tr.seq_len, seed=tr.seed)
        if self.world.is_main:
            self.dataset.prepare()
        distributed.barrier()
        if not self.world.is_main:
            self.dataset.prepare()
        self.train_loader = self.dataset.loader(
            "train", micro_batch=tr.micro_batch, global_batch=tr.global_batch,
            rank=self.data_rank, world_size=self.data_ranks,
        )
        self.total_steps = batch_plan.total_steps(
            tr, self.plan, getattr(self.train_loader, "steps_per_epoch", None))
        if recipe.eval.at_end or 0 < recipe.eval.interval <= self.total_steps:
            getattr(eval_loader(self), "close", lambda: None)()  # fits one batch, or fails now
        phase("data")
        self.model = self._build_model()
        phase("model build")
        self.flops_per_token = float(self.model.flops_per_token(tr.seq_len))  # whole model
        self.num_params = self.model.num_params()  # (before a pipeline split)
        self.parallel_summary = self._parallelize()
        phase("parallelize")
        self.optimizers = OptimizerSet(self.model, recipe.optimizer_tables(), self.total_steps)
        self.guards = {name: cfg.build(run_dir=self.run_dir) for name, cfg in recipe.guards.items()}
        self.step_fn = tr.step.build()
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if tr.mixed_precision == "bf16" else contextlib.nullcontext()
        )
        self.metrics = MetricsWriter(self.run_dir, tensorboard=recipe.run.tensorboard,
                                     enabled=self.world.is_main, wandb=recipe.run.wandb,
                                     run_name=recipe.run.name, config=to_dict(recipe))
        self.watchdog = Watchdog(recipe.run.watchdog)  # the loop marks each step's window
        self.hooks: list[Hook] = standard_hooks(recipe, self.watchdog)
        # The checkpoint hook starts first (it resumes) but ends each step after the hooks that
        # log the step: a snapshot is never published before its step's metrics are written.
        self.resumer = checkpoint_hook(self) if checkpoints and recipe.checkpoint.enable \
            else None
        self.hooks += [h for h in (self.resumer, *(hooks or [])) if h is not None]
        phase("optimizers, hooks")

    # ----------------------------------------------------------------------------- building
    def _build_model(self) -> torch.nn.Module:
        tr = self.recipe.training
        from kiln.components.models.block import padded_vocab

        vocab = padded_vocab(self.recipe.model, self.tokenizer.vocab_size)
        if self.recipe.parallelism.meta_init:  # allocated and initialised after parallelize
            with torch.device("meta"):
                model = self.recipe.model.build(vocab_size=vocab, seq_len=tr.seq_len)
        else:
            model = self.recipe.model.build(vocab_size=vocab, seq_len=tr.seq_len)
        if getattr(model, "vocab_size", vocab) < self.tokenizer.vocab_size:
            raise RecipeError(
                f"model.vocab_size = {model.vocab_size} is smaller than the tokenizer's "
                f"vocabulary ({self.tokenizer.vocab_size}); raise it or set 0 to use the "
                "tokenizer's (rounded up to model.vocab_multiple)"
            )
        if tr.loss_chunk_tokens and "head" not in inspect.signature(model.forward).parameters:
            raise RecipeError(
                f"training.loss_chunk_tokens = {tr.loss_chunk_tokens} needs a model whose "
                f"forward takes head= (docs/design.md); {type(model).__name__} does not: set "
                "training.loss_chunk_tokens = 0"
            )
        return model if self.recipe.parallelism.meta_init else model.to(self.device)

    def _parallelize(self) -> str:
        # Parallelism call site: pipeline split -> float8 -> activation checkpointing -> compile
        # -> FSDP2 (or gradient all-reduce without FSDP), then meta-device init (parallelisms).
        from kiln.parallelisms import materialize, parallelize
        from kiln.parallelisms.compile import compile_loss

        pcfg, tables = self.recipe.parallelism, self.recipe
        if not pcfg.meta_init and self.world.distributed:
            for t in [*self.model.parameters(), *self.model.buffers()]:  # same weights everywhere
                distributed.broadcast_(t.data, src=0)
        self.parallel = parallelize(
            self.model, pcfg, self.world, mesh=self.health.mesh, ep_mesh=self.health.ep_mesh,
            training=tables.training, grad_accum=self.plan.grad_accum,
            checkpoint=tables.checkpoint, attention=getattr(tables.model, "attention", None))
        details = self.parallel.describe().splitlines()[1:]
        if note := chunked_loss_note(self.recipe.training, self.mesh_layout.tp):
            details.append(note)
        if pcfg.meta_init:
            details.append(materialize(
                self.model, self.device, self.recipe.training.seed, mode=pcfg.init_mode,
                replica_max_params=pcfg.replica_init_max_params, pipeline=self.parallel.pipeline,
            ))
        if self.recipe.training.init_check and self.world.distributed:
            from kiln.recipes.init_check import check_identical_init

            details.append(check_identical_init(self.model, self.parallel.stage_group))
        if pcfg.compile_loss:
            self.cross_entropy = compile_loss(F.cross_entropy, pcfg, self.device)
            self.chunk_loss = compile_loss(chunk_loss_sum, pcfg, self.device)
        for line in details:
            self.print(f"parallelism: {line}")
        self.model_inputs = ModelInputs(getattr(self.recipe.model, "attention", None),
                                        self.device, cp=self.parallel.cp)
        self.model_inputs.check_model(self.model)
        if line := self.model_inputs.describe():
            self.print(line)
        kernels = getattr(self.model, "resolve_kernels", None)  # e.g. MoE: decided up front
        if kernels is not None and (line := kernels(self.device, self.compute_dtype)):
            self.print(f"model: {line}")
        return self.parallel.summary

    @property
    def layout(self) -> dict:
        """How the run is spread over processes: saved with every checkpoint (``run_layout``)."""
        return run_layout(self)

    def _start_from_pretrained(self) -> None:
        """``checkpoint.init_from``: pretrained weights for a run that did not resume."""
        if not self.recipe.checkpoint.init_from or getattr(self.resumer, "resumed_from", None):
            return
        from kiln.recipes.pretrained import load_pretrained

        load_pretrained(self)

    # -------------------------------------------------------- helpers the step components use
    @functools.cached_property
    def peak_flops(self) -> float:
        """Peak FLOP/s per device for MFU, found lazily, its source printed once (flops.py)."""
        return trainer_peak(self) if self.world.is_main else 0.0

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in: bf16 under autocast or FSDP2 bf16 params, else fp32."""
        bf16 = self.recipe.training.mixed_precision == "bf16" or (
            self.recipe.parallelism.param_dtype == "bfloat16")
        return torch.bfloat16 if bf16 else torch.float32

    @property
    def tokens_per_step(self) -> int:
        """Tokens trained on in this step, all ranks (shorter during a context warmup)."""
        return self.plan.global_batch * self.seq_len

    def zero_grad(self) -> None:
        self.optimizers.zero_grad()

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy of one micro-batch (fp32 loss under autocast); under
        pipeline parallelism forward through every stage (evaluation; the same on all ranks)."""
        if self.parallel.pipeline is not None:
            return self.parallel.pipeline.eval_loss(batch, self.stage_loss, self.autocast)
        ids, labels, extra = self.model_inputs(batch)  # this rank's tokens, attention context
        return self.stage_loss(lambda **kw: self.model(ids, **kw, **extra), labels)

    def stage_loss(self, run, labels: torch.Tensor) -> torch.Tensor:
        """The loss of ``run(**kw)`` (the model's or last pipeline stage's forward), chunked via
        its ``head=`` with ``training.loss_chunk_tokens`` (not under tp: sharded logits)."""
        chunk = self.recipe.training.loss_chunk_tokens if self.parallel.tp is None else 0
        if chunk:
            with self.autocast:
                loss = run(head=LossHead(labels, chunk, self.chunk_loss))
        else:
            with self.autocast:
                logits = run()  # (B, T, V)
            # Through the plan: with loss parallel the logits are sharded over the vocabulary.
            loss = self.parallel.loss(self.cross_entropy, logits.flatten(0, 1).float(),
                                      labels.flatten())
        pop_aux = getattr(self.model, "pop_aux_loss", None)  # e.g. MoE balance losses
        aux = pop_aux() if pop_aux is not None else None
        # The auxiliary loss adds its gradient, not its value: the reported loss stays the CE.
        return loss if aux is None else loss + (aux - aux.detach())

    def grad_sync(self, is_last_microbatch: bool):
        """Around each micro-batch's backward: FSDP2 reduces gradients on the last one only."""
        return self.parallel.grad_sync(is_last_microbatch)

    def sync_grads(self) -> None:
        """After the last backward: all-reduce gradients when replicated without FSDP."""
        self.parallel.sync_grads()

    def clip_grads(self) -> torch.Tensor:
        """Clip to the global norm over all shards (grad_clip 0 = measure only)."""
        return self.parallel.clip_grads(self.recipe.training.grad_clip)

    def global_stats(self, **values: torch.Tensor | None) -> dict[str, float]:
        """Average the per-rank loss over ranks; one host sync for everything."""
        keys = [k for k, v in values.items() if v is not None]
        packed = torch.stack([values[k].detach().float().to(self.device) for k in keys])
        if self.world.distributed and "loss" in keys:
            distributed.all_reduce_(packed[keys.index("loss"):keys.index("loss") + 1])
            packed[keys.index("loss")] /= self.world.world_size
        return dict(zip(keys, packed.tolist(), strict=True))

    def guard_decision(self, stats: dict[str, float], segment: int) -> GuardDecision:
        if not self.guards:  # non-finite values stop the run (one clear error), never the weights
            return unguarded(stats)
        for guard in self.guards.values():
            decision = guard.decide(stats, self.progress.step, segment)
            if decision.skip or decision.abort:
                return decision
        return GuardDecision()

    def optimizer_step(self, decision: GuardDecision, stats: dict[str, float], *,
                       segment: int, last_segment: bool) -> None:
        for guard in self.guards.values():
            guard.commit(decision, stats, self.progress.step, segment)
        if decision.abort:
            raise TrainingAborted(f"step {self.progress.step + 1}: {decision.reason}")
        if not decision.skip:
            self.optimizers.set_lr(self.progress.step)
            self.optimizers.step(last_segment=last_segment)
            self.parallel.after_optimizer_step()
        hook = getattr(self.model, "on_optimizer_step", None)
        if hook is not None:
            hook(decision.skip)

    def end_step(self, result) -> None:
        """After the step function: count the step and tell the model the global step is over
        (``on_global_step(skipped)``: skipped if any of its optimizer steps was; e.g. the MoE
        bias moves once per global step from the loads of all its segments)."""
        self.progress.step += 1
        self.progress.tokens += result.tokens
        self.watchdog.step_ends(self.progress.step)
        hook = getattr(self.model, "on_global_step", None)
        if hook is not None:
            hook(result.skipped)

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.device.type == "cpu":
            return batch
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def print(self, text: str) -> None:
        if self.world.is_main:
            from tqdm import tqdm

            tqdm.write(text, file=self.out)  # keeps the progress bar intact
            self.out.flush()  # line by line also into a file or a pipe (`tail -f` a log)

    # ------------------------------------------------------------------------------- the loop
    def fit(self) -> Progress:
        self.print(f"kiln: {self.recipe.run.name}: {self.total_steps} steps, "
                   f"{self.num_params:,} parameters, {self.parallel_summary}")
        self.print(f"batch: global {self.plan.global_batch} x seq {self.plan.seq_len} = "
                   f"{self.plan.tokens_per_step:,} tokens/step; micro {self.plan.micro_batch} "
                   f"x accum {self.plan.grad_accum} per rank")
        self.print("optimizers:\n" + self.optimizers.table())
        try:
            for hook in start_order(self.hooks, self.resumer):
                hook.on_train_start(self)
            if self.progress.step >= self.total_steps:
                self.print(f"kiln: {self.recipe.run.name} already finished: step "
                           f"{self.progress.step} of {self.total_steps} in {self.run_dir}; nothing "
                           "to do (raise training.steps to continue it, or give another "
                           "--run.folder to start over)")
                return self.progress
            self._start_from_pretrained()
            self.metrics.begin_session(self.progress.step)  # after the resume set the step
            batches = iter(self.train_loader)
            self.model.train()
            set_progress = getattr(self.model, "set_progress", None)  # schedules inside a model
            warmup = self.recipe.training.context_warmup
            started = False
            while self.progress.step < self.total_steps and not self.stop_requested:
                self.watchdog.step_begins()
                waited = time.perf_counter()
                micro = [self.to_device(next(batches)) for _ in range(self.plan.grad_accum)]
                self.data_wait_s += time.perf_counter() - waited
                self.seq_len = context_length(self.progress.step, self.plan.seq_len, warmup)
                if self.seq_len < self.plan.seq_len:
                    micro = [truncate(b, self.seq_len) for b in micro]
                if set_progress is not None:
                    set_progress(self.progress.step, self.total_steps)
                # Every generator from (seed, step): the same on all ranks and for any layout,
                # so a resume on other processes needs no RNG mapping.
                seed_step(self.recipe.training.seed, self.progress.step)
                result = self.step_fn(self, micro)
                if self.world.is_main and not started:
                    self.run_dir.mkdir(parents=True, exist_ok=True)
                    write_text_atomic(self.run_dir / "recipe.toml", self.recipe_toml)
                started = True
                self.end_step(result)
                for hook in self.hooks:
                    hook.on_step_end(self, result)
            for hook in self.hooks:
                hook.on_train_end(self)
            self.print(self.metrics.where())
        finally:
            for hook in self.hooks:
                hook.close(self)
            self.metrics.close()
            close_loader = getattr(self.train_loader, "close", None)  # e.g. a read-ahead thread
            if close_loader is not None:
                close_loader()
        return self.progress

"""The trainer: builds a run from a resolved recipe and loops over steps; hooks do the rest.

The loop (``fit``) is short on purpose: the step component computes one optimizer step, and
logging, evaluation, checkpointing and profiling hang off hooks (``recipes/hooks/``). The step
sees a ``TrainStepContext`` (``step_context.py``), never the trainer.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from pathlib import Path

import torch

from kiln.checkpointing.layout import check_no_stray_snapshots
from kiln.checkpointing.rng import seed_step
from kiln.components import distributed
from kiln.components.protocols import Hook, complete_model
from kiln.parallelisms.health.check import run_health_check
from kiln.parallelisms.layout.check import chunked_loss_note
from kiln.recipes.config.files import render_recipe, to_dict
from kiln.recipes.config.schema import Recipe
from kiln.recipes.preflight import checks
from kiln.recipes.probes.flops import trainer_peak
from kiln.recipes.probes.process_stats import Phases
from kiln.recipes.training.context_warmup import context_length, truncate
from kiln.recipes.training.hook_set import by_priority, checkpoint_hook, standard_hooks
from kiln.recipes.training.metrics import MetricsWriter
from kiln.recipes.training.model_inputs import ModelInputs
from kiln.recipes.training.optimizer_set import OptimizerSet
from kiln.recipes.training.run_hooks import CloseLoader, WriteRecipe
from kiln.recipes.training.run_layout import run_layout
from kiln.recipes.training.step_build import StepBuild
from kiln.recipes.training.step_context import Progress, TrainStepContext, padding_cut


class Trainer:
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
        self.mesh_layout, self.plan = checks.plan_layout(recipe, self.world.world_size)
        checks.check_init_from(recipe)  # before anything is built
        self.data_rank = self.mesh_layout.dp_rank(self.world.rank)
        self.data_ranks = self.mesh_layout.dp
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
        data = checks.open_data(recipe, self.tokenizer, self.plan, rank=self.data_rank,
                                ranks=self.data_ranks, prepare=self._prepare)
        self.dataset, self.train_loader = data.dataset, data.train_loader
        self.total_steps = data.total_steps
        for line in data.lines:
            self.print(line)
        phase("data")
        self.model = self.build_model()
        # An adapter run from init_from checkpoints its adapters only: the frozen base is the
        # init_from weights, read again on resume.
        self.adapter = None  # the built [adapter] (AdapterContract)
        self.saved_params = None
        self.base_record: dict | None = None  # its base's init_from and fingerprint
        self.frozen_record: dict | None = None  # the same of a step's frozen models, by source
        self.parent: dict | None = None  # the run whose weights this one starts from, if any
        if recipe.adapter is not None:
            self.adapter, line = checks.add_adapter(recipe, self.model)
            self.print(line)
            if recipe.checkpoint.init_from:
                self.saved_params = self.adapter.owns
        phase("model build")
        self.step_fn = checks.build_step(recipe)
        self.flops_per_token = checks.flops_per_token(self.model, self.step_fn, tr.seq_len)
        self.num_params = self.model.num_params()  # (before a pipeline split)
        self.parallel_summary = self._parallelize()
        phase("parallelize")
        self.optimizers = OptimizerSet(self.model, recipe.optimizer_tables(), self.total_steps)
        self.guards = {name: cfg.build(run_dir=self.run_dir) for name, cfg in recipe.guards.items()}
        checks.check_step_data(recipe, self.dataset, self.step_fn, self.mesh_layout)
        if self.dataset.pairs and (line := self.dataset.describe()):
            self.print(line)  # (masked chat data says it with its token weighting)
        self.autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if tr.mixed_precision == "bf16" else contextlib.nullcontext()
        )
        cut, line = padding_cut(self.model, self.parallel, self.model_inputs, self.dataset)
        if line:
            self.print(line)
        self.step_context = TrainStepContext(
            model=self.model, world=self.world, parallel=self.parallel,
            model_inputs=self.model_inputs, optimizers=self.optimizers, guards=self.guards,
            progress=self.progress, total_steps=self.total_steps,
            global_batch=self.plan.global_batch, seq_len=self.seq_len, grad_clip=tr.grad_clip,
            loss_chunk_tokens=tr.loss_chunk_tokens, autocast=self.autocast,
            source_losses=self._source_losses(), token_weighted=self._token_weighted(),
            data_ranks=self.data_ranks, cut_padding=cut, **self.compiled_losses)
        build = StepBuild(self)
        self.step_fn.setup(build)  # a reference, a teacher: before any resume changes the policy
        if checks.trunk_only(self.model, self.step_fn):
            build.lines.append(f"step: {recipe.training.step.type} trains the main head only; "
                               "the multi-token prediction modules keep their weights")
        for line in build.lines:
            self.print(line)
        self.metrics = MetricsWriter(self.run_dir, tensorboard=recipe.run.tensorboard,
                                     enabled=self.world.is_main, wandb=recipe.run.wandb,
                                     run_name=recipe.run.name, config=to_dict(recipe))
        # The checkpoint hook resumes before any hook starts, and ends each step after the hooks
        # that log the step: a snapshot is never published before its step's metrics.
        self.resumer = checkpoint_hook(self) if checkpoints and recipe.checkpoint.enable \
            else None
        extra = [WriteRecipe(), CloseLoader(), *(hooks or [])]
        self.hooks: list[Hook] = by_priority(
            [*standard_hooks(recipe), *([self.resumer] if self.resumer else []), *extra])
        phase("optimizers, hooks")

    # ----------------------------------------------------------------------------- building
    def build_model(self) -> torch.nn.Module:
        """The recipe's model, completed and checked, on the device (or the meta device for
        meta init): the policy, and a step's frozen models (``step_build``)."""
        tr = self.recipe.training
        from kiln.components.models.block import padded_vocab

        vocab = padded_vocab(self.recipe.model, self.tokenizer.vocab_size)
        if self.recipe.parallelism.meta_init:  # allocated and initialised after parallelize
            with torch.device("meta"):
                model = self.recipe.model.build(vocab_size=vocab, seq_len=tr.seq_len)
        else:
            model = self.recipe.model.build(vocab_size=vocab, seq_len=tr.seq_len)
        complete_model(model)  # a plugin model gets the optional methods' no-op defaults
        checks.check_model(self.recipe, model, self.tokenizer)
        return model if self.recipe.parallelism.meta_init else model.to(self.device)

    def _prepare(self, dataset) -> None:
        """Rank 0 prepares the data first (builds a cache entry), the other ranks then read it."""
        if self.world.is_main:
            dataset.prepare()
        distributed.barrier()
        if not self.world.is_main:
            dataset.prepare()

    def _token_weighted(self) -> bool:
        """Masked data (``chat``) takes the mean over the global batch's trained tokens."""
        weighted = checks.token_weighted(self.recipe, self.dataset, self.step_fn,
                                         self.mesh_layout)
        if weighted and (line := self.dataset.describe()):
            self.print(line)
        return weighted

    def _source_losses(self):
        """Per-source training loss for a dataset with ``source_names`` (a mixture), where the
        loss sees whole logits (chunked or not); elsewhere a line says why it is not logged
        (``data/tokens/NAME`` and the per-source evaluations are logged on every path)."""
        names = self.dataset.source_names
        if not names:
            return None
        why = ("pipeline parallelism" if self.parallel.pipeline is not None
               else "loss parallel (sharded logits)" if self.parallel.loss_parallel else "")
        if why:
            self.print(f"data: train/loss/NAME per source is not logged under {why}; "
                       "eval/loss/NAME and data/tokens/NAME are")
            return None
        from kiln.recipes.training.step_context import SourceLosses

        return SourceLosses(len(names), self.device)

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
            from kiln.parallelisms.health.init_check import check_identical_init

            details.append(check_identical_init(self.model, self.parallel.stage_group))
        self.compiled_losses = {}
        if pcfg.compile_loss:
            from kiln.components.models.lm_head import chunk_loss_sum

            self.compiled_losses = {
                "cross_entropy": compile_loss(torch.nn.functional.cross_entropy, pcfg,
                                              self.device),
                "chunk_loss": compile_loss(chunk_loss_sum, pcfg, self.device)}
        for line in details:
            self.print(f"parallelism: {line}")
        self.model_inputs = ModelInputs(getattr(self.recipe.model, "attention", None),
                                        self.device, cp=self.parallel.cp)
        self.model_inputs.check_model(self.model)
        if line := self.model_inputs.describe():
            self.print(line)
        if line := self.model.resolve_kernels(  # e.g. MoE
                self.device, self.compute_dtype, compiling=self.recipe.parallelism.compile):
            self.print(f"model: {line}")
        return self.parallel.summary

    @property
    def data_record(self) -> dict:
        """What the run's data is (each source's fingerprint, a mixture's stage steps): saved
        with every checkpoint, checked on resume (``checkpointing/resume.check_data``)."""
        return {"fingerprints": self.dataset.fingerprints(), "stages": self.dataset.stage_steps()}

    @property
    def layout(self) -> dict:
        """How the run is spread over processes: saved with every checkpoint (``run_layout``)."""
        return run_layout(self)

    def _start_from_pretrained(self) -> None:
        """``checkpoint.init_from``: pretrained weights for a run that did not resume, or the
        frozen base of an adapters-only checkpoint, checked against the base it was trained on
        (its weights' fingerprint)."""
        resumed = self.resumer.resumed_from if self.resumer is not None else None
        if not self.recipe.checkpoint.init_from or (resumed and self.saved_params is None):
            return  # (an adapters-only checkpoint needs its base read again)
        from kiln.checkpointing.resume import check_base
        from kiln.recipes.loading.init_from import load_pretrained
        from kiln.recipes.loading.weights import place

        started = load_pretrained(self.model, self.recipe, is_main=self.world.is_main,
                                  adapters_only=self.saved_params is not None,
                                  resumed=bool(resumed))
        for line in started.lines:
            self.print(line)
        self.base_record, self.parent = started.base_record, started.parent or self.parent
        if resumed and (line := check_base(Path(resumed), self.base_record, place)):
            self.print(line)
        if not resumed and self.adapter is not None:
            self.adapter.on_base_loaded(self.model)  # e.g. DoRA's magnitudes: the base's norms

    def _check_frozen(self) -> None:
        """A resumed run's frozen models (a reference) against the weights it trained with."""
        from kiln.recipes.training.step_build import check_frozen

        resumed = self.resumer.resumed_from
        if resumed and not self.recipe.checkpoint.weights_only:
            for line in check_frozen(Path(resumed), self.frozen_record):
                self.print(line)

    # -------------------------------------------------------- helpers the step components use
    @functools.cached_property
    def peak_flops(self) -> float:
        """Peak FLOP/s per device for MFU, found lazily, its source printed once (flops.py)."""
        return trainer_peak(self) if self.world.is_main else 0.0

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in: bf16 under autocast or FSDP2 bf16 params, else fp32."""
        return checks.compute_dtype(self.recipe)

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token loss of one micro-batch, as the step computes it (evaluation)."""
        return self.step_context.forward_loss(batch)

    def end_step(self, result) -> None:
        """After the step function: count the step and tell the model the global step is over
        (``on_global_step(skipped)``: skipped if any of its optimizer steps was; e.g. the MoE
        bias moves once per global step from the loads of all its segments)."""
        self.progress.step += 1
        self.progress.tokens += result.tokens
        self.model.on_global_step(result.skipped)

    def sequence_length(self, step: int) -> int:
        """Tokens a sequence trains on at optimizer step ``step`` (0-based): ``seq_len``, less
        during a context warmup."""
        return context_length(step, self.plan.seq_len, self.recipe.training.context_warmup)

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
            if self.resumer is not None:
                self.resumer.resume(self)  # the hooks start from the resumed progress
                self._check_frozen()
            elif not self.recipe.checkpoint.enable:  # a run folder with snapshots: not anew
                check_no_stray_snapshots(self.run_dir, None, "checkpoint.enable = false")
            for hook in self.hooks:
                hook.on_train_start(self)
            if self.progress.step >= self.total_steps:
                self.print(f"kiln: {self.recipe.run.name} already finished: step "
                           f"{self.progress.step} of {self.total_steps} in {self.run_dir}; nothing "
                           "to do (raise training.steps to continue it, or give another "
                           "--run.folder to start over)")
                return self.progress
            self._start_from_pretrained()
            self.metrics.begin_session(self.progress.step, self.total_steps)  # after resume
            batches = iter(self.train_loader)
            self.model.train()
            started = False
            while self.progress.step < self.total_steps and not self.stop_requested:
                for hook in self.hooks:
                    hook.on_step_start(self)
                waited = time.perf_counter()
                micro = [self.to_device(next(batches)) for _ in range(self.plan.grad_accum)]
                self.data_wait_s += time.perf_counter() - waited
                self.seq_len = self.sequence_length(self.progress.step)
                if self.seq_len < self.plan.seq_len:
                    micro = [truncate(b, self.seq_len) for b in micro]
                self.model.set_progress(self.progress.step, self.total_steps)
                self.step_context.seq_len = self.seq_len
                # Every generator from (seed, step): the same on all ranks and for any layout,
                # so a resume on other processes needs no RNG mapping.
                seed_step(self.recipe.training.seed, self.progress.step)
                self.step_context.flop_tokens = 0.0
                result = self.step_fn(self.step_context, micro)
                if self.step_context.flop_tokens and result.flop_tokens is None:
                    # (this rank's count for every data rank: their rows are as wide)
                    result.flop_tokens = self.step_context.flop_tokens * self.data_ranks
                if not started:
                    for hook in self.hooks:
                        hook.on_first_step(self)
                started = True
                self.end_step(result)
                for hook in self.hooks:
                    hook.on_step_end(self, result)
            for hook in self.hooks:
                hook.on_train_end(self)
            self.print(self.metrics.where())
        finally:
            for hook in reversed(self.hooks):  # the first to start is the last to close
                hook.close(self)
            self.metrics.close()
        return self.progress

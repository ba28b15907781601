"""What a step component works with: the trainer's ``StepContext`` (``components/protocols.py``).

The trainer builds one and hands it to the step each step. Its parts are passed in, so a test
builds one around a bare model without a trainer, data or run folder.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kiln.components import distributed
from kiln.components.attention import shared_prefix
from kiln.components.errors import TrainingAborted
from kiln.components.models.lm_head import IGNORE_INDEX, LossHead, TokenLosses, chunk_loss_sum
from kiln.components.models.token_logprobs import LogprobHead, label_logprobs
from kiln.components.protocols import GuardDecision
from kiln.components.steps.common import unguarded
from kiln.recipes.training.context_warmup import truncate


@dataclass
class Progress:
    """How far training got: optimizer steps taken and tokens consumed (all ranks)."""

    step: int = 0
    tokens: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens}

    def load_state_dict(self, d: dict) -> None:
        self.step, self.tokens = int(d["step"]), int(d["tokens"])


class SourceLosses:
    """Per data source: the summed token losses and the token count of the training batches
    since the last ``take`` (a mixture's ``source_ids`` say each row's source). On the device,
    no host sync: the log hook reads them every log interval."""

    def __init__(self, n: int, device: torch.device) -> None:
        self.sums = torch.zeros(n, 2, dtype=torch.float64, device=device)

    def add(self, rows: torch.Tensor, per_token: torch.Tensor, labels: torch.Tensor) -> None:
        """``per_token`` (B*T,) losses of ``labels`` (B, T); ``rows`` (B,) their sources."""
        valid = labels != IGNORE_INDEX
        loss = (per_token.view(labels.shape) * valid).sum(1, dtype=torch.float64)  # (B,)
        count = valid.sum(1, dtype=torch.float64)
        self.sums.index_add_(0, rows.to(self.sums.device), torch.stack([loss, count], 1))

    def take(self) -> torch.Tensor:
        """(sources, 2): [loss sum, tokens] since the last call, this rank's; then zero."""
        out = self.sums.clone()
        self.sums.zero_()
        return out


def without_trailing_padding(batch: dict[str, torch.Tensor],
                             multiple: int = 1) -> dict[str, torch.Tensor]:
    """The batch cut after its last labelled column, rounded up to a ``multiple``: its (B, T)
    tensors to (B, T') (rows padded to ``seq_len``, as preference pairs are, run as wide as
    their longest). One host read."""
    labelled = (batch["labels"] != IGNORE_INDEX).any(0).nonzero()
    if not labelled.numel():
        return batch
    return truncate(batch, -(-(int(labelled[-1]) + 1) // multiple) * multiple)


# A cut micro-batch's width is a multiple of this: float8's matrix products on a GPU need the
# tokens of a micro-batch to be a multiple of 16 (parallelisms/float8.py), and fewer distinct
# widths are fewer allocator sizes.
CUT_MULTIPLE = 16


def padding_cut(model: torch.nn.Module, parallel: Any, model_inputs: Any,
                dataset: Any) -> tuple[int, str]:
    """(the width multiple ``forward_loss`` cuts micro-batches to, or 0, and a line for the
    log). Data whose rows end in padding (``dataset.padded_rows``: one conversation a row) runs
    each micro-batch as wide as its longest row: causal, no labelled token sees the columns
    cut. Not where the width is fixed or the padding counts: pipeline stages, context or
    tensor parallel shares of a row, compiled blocks (a recompile per width), MoE routing (its
    balance loss and expert loads count every token of the batch), a loop carry (a state per
    row and position)."""
    if not dataset.padded_rows:
        return 0, ""
    why = None
    if parallel.pipeline is not None or parallel.tp is not None or model_inputs.cp is not None:
        why = "pipeline, tensor and context parallelism keep every micro-batch at seq_len"
    elif getattr(model, "carry_state", lambda: None)() is not None:
        why = "the loop carry holds a state per row and position"
    for name, module in model.named_modules():
        if why:
            break
        if getattr(module, "_compiled_call_impl", None) is not None:
            why = f"{name or 'the model'} is compiled (every width would compile anew)"
        elif getattr(type(module), "counts_batch_tokens", False):
            why = f"{name} ({type(module).__name__}) counts the batch's tokens, padding too"
    if why:
        return 0, f"padded rows run at training.seq_len: {why}"
    return CUT_MULTIPLE, ("padded rows: each micro-batch runs as wide as its longest row "
                          f"(rounded up to a multiple of {CUT_MULTIPLE})")


@dataclass
class TrainStepContext:
    """The model, its parallel plan, inputs, optimizers and guards, as one step sees them."""

    model: torch.nn.Module
    world: distributed.World
    parallel: Any  # kiln.parallelisms.ParallelPlan
    model_inputs: Any  # kiln.recipes.training.model_inputs.ModelInputs
    optimizers: Any  # kiln.recipes.training.optimizer_set.OptimizerSet
    guards: dict[str, Any]
    progress: Progress
    total_steps: int
    global_batch: int
    seq_len: int  # of the current step: shorter during a context warmup
    grad_clip: float = 1.0
    loss_chunk_tokens: int = 0
    autocast: Any = field(default_factory=contextlib.nullcontext)
    # parallelisms.compile_loss may swap in compiled versions of both.
    cross_entropy: Any = F.cross_entropy
    chunk_loss: Any = chunk_loss_sum
    # A mixture's per-source training loss (the trainer sets it where it can be measured).
    source_losses: SourceLosses | None = None
    # Masked data (``chat``): the loss is the mean over the global batch's trained tokens.
    token_weighted: bool = False
    data_ranks: int = 1  # ranks with distinct batches (the others are tensor-parallel peers)
    cut_padding: int = 0  # ``padding_cut``'s multiple: micro-batches cut after their last label
    # token_logprobs' passes since the trainer last took them (StepResult.flop_tokens): this
    # rank's tokens, forward-and-backward equivalents
    flop_tokens: float = 0.0
    # shared_prefix.problem per (model, training): what stops a model sharing prompts
    _share_problems: dict = field(default_factory=dict, repr=False)

    @property
    def device(self) -> torch.device:
        return self.world.device

    @property
    def pipeline(self) -> Any:
        return self.parallel.pipeline

    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def micro_weights(self, micro_batches: list[dict[str, torch.Tensor]]
                      ) -> tuple[list[float], int]:
        """For ``token_weighted`` (masked) data: (each micro-batch's loss weight ``count_i * W /
        C``, the global batch's trained tokens), ``C`` the trained tokens of all ``W`` ranks
        (one all-reduce of a count): the
        gradient average over ranks then gives the sum over trained tokens divided by ``C``,
        whatever the micro-batch count or world size. Tensor-parallel peers count the same
        batch, which scales ``W`` and ``C`` alike."""
        counts = [int(c) for c in torch.stack(  # one host sync for all micro-batches
            [(b["labels"] != IGNORE_INDEX).sum() for b in micro_batches]).tolist()]
        total = torch.tensor([float(sum(counts))], dtype=torch.float64)
        if self.world.distributed:
            distributed.all_reduce_(total)
        everyone = int(total.item())
        if everyone == 0:
            raise TrainingAborted(
                f"step {self.progress.step + 1}: the global batch has no trained token (every "
                "label is masked); check the data's train_on and its assistant turns")
        if 0 in counts:
            raise TrainingAborted(
                f"step {self.progress.step + 1}: micro-batch {counts.index(0)} has no trained "
                "token (every label is masked; a context warmup may have cut them off)")
        world = self.world.world_size if self.world.distributed else 1
        # Peers of a tensor-parallel group count the same rows: the distinct tokens are fewer.
        return [c * world / everyone for c in counts], everyone * self.data_ranks // world

    def zero_grad(self) -> None:
        self.optimizers.zero_grad()

    def forward_loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Mean next-token cross-entropy of one micro-batch (fp32 loss under autocast); under
        pipeline parallelism forward through every stage (evaluation; the same on all ranks)."""
        if self.parallel.pipeline is not None:
            return self.parallel.pipeline.eval_loss(batch, self.stage_loss, self.autocast)
        if self.cut_padding:
            batch = without_trailing_padding(batch, self.cut_padding)
        ids, labels, extra = self.model_inputs(batch)  # this rank's tokens, attention context
        if self.cut_padding:  # what ran, for MFU (a cut micro-batch ran fewer than seq_len)
            self.flop_tokens += ids.numel() * (1.0 if torch.is_grad_enabled() else 1 / 3)
        if getattr(self.model, "mtp", None) is not None:  # multi-token prediction's targets
            extra = {**extra, "mtp_labels": labels}
        rows = batch.get("source_ids") if self.source_losses is not None else None
        return self.stage_loss(lambda **kw: self.model(ids, **kw, **extra), labels, rows=rows)

    def token_logprobs(self, batch: dict[str, torch.Tensor],
                       model: torch.nn.Module | None = None, temperature: float = 1.0,
                       vocab: int | None = None, groups: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each trained token's log-probability of its label through ``model`` (the policy by
        default; as a sampler sees them: the logits divided by ``temperature``, cut to the
        first ``vocab``), fp32 (B, T), and the trained mask. With ``training.loss_chunk_tokens`` the
        head runs in chunks (``token_logprobs.LogprobHead``: no (B, T, V) logits). ``groups``
        (G, K): rows that begin with the same prompt, which the forward then computes once
        (``attention/shared_prefix.py``) where the model allows it. The columns after the
        last labelled one (right padding) are not computed: causal, the rows' earlier tokens do
        not see them (not under context parallelism, whose ranks hold interleaved shares).
        Not under pipeline or tensor parallelism yet (logits on other ranks, or sharded)."""
        if self.parallel.pipeline is not None or self.parallel.tp is not None:
            raise TrainingAborted("token log-probabilities need whole logits on every rank: "
                                  "not under pipeline or tensor parallelism yet")
        model = self.model if model is None else model
        width = batch["labels"].shape[1]
        if self.model_inputs.cp is None:
            batch = without_trailing_padding(batch)
        ids, labels, extra = self.model_inputs(batch)
        layout = None if groups is None else self.shared_layout(model, batch, ids, groups)

        def run(**kw):  # the rows as they are, or packed around their prompts
            return model(ids, **kw, **extra) if layout is None else layout.run(model, ids, **kw)

        with self.autocast:
            if self.loss_chunk_tokens:
                logp = run(head=LogprobHead(labels, self.loss_chunk_tokens, temperature, vocab))
            else:
                logits = run()[..., :vocab].float()
                logp = label_logprobs(logits / temperature, labels)
        computed = ids.numel() if layout is None else layout.packed_tokens
        self.flop_tokens += computed * (1.0 if torch.is_grad_enabled() else 1 / 3)
        trained = labels != IGNORE_INDEX
        if self.model_inputs.cp is None and labels.shape[1] < width:  # the cut columns: 0
            cut = width - labels.shape[1]
            logp, trained = F.pad(logp, (0, cut)), F.pad(trained, (0, cut))
        return logp, trained

    def shared_layout(self, model: torch.nn.Module, batch: dict[str, torch.Tensor],
                      ids: torch.Tensor, groups: torch.Tensor
                      ) -> shared_prefix.PrefixLayout | None:
        """The layout that runs ``groups``' prompts once, or None: the model cannot share
        (``shared_prefix_problem``), context parallel holds part of each row, a row holds
        several documents under a document mask, or the prompts are too short to pay."""
        if self.shared_prefix_problem(model) is not None or self.model_inputs.cp is not None:
            return None
        docs = batch.get("doc_ids") if self.model_inputs.document_mask else None
        if docs is not None and bool((docs != docs[:, :1]).any()):
            return None
        return shared_prefix.plan(ids, groups.to(ids.device))

    def shared_prefix_problem(self, model: torch.nn.Module | None = None) -> str | None:
        """Why ``model`` (the policy by default) cannot compute a shared prompt once (None:
        it can); asked once per model and mode (training, evaluation)."""
        model = self.model if model is None else model
        key = (id(model), model.training)
        if key not in self._share_problems:
            self._share_problems[key] = shared_prefix.problem(model)
        return self._share_problems[key]

    def stage_loss(self, run, labels: torch.Tensor,
                   rows: torch.Tensor | None = None) -> torch.Tensor:
        """The loss of ``run(**kw)`` (the model's or last pipeline stage's forward), chunked via
        its ``head=`` with ``training.loss_chunk_tokens`` (not under tp: sharded logits).
        ``rows``: each row's data source; its token losses then go to ``source_losses`` too
        (not with vocabulary-sharded logits: the trainer sets ``source_losses`` only where
        they are whole)."""
        chunk = self.loss_chunk_tokens if self.parallel.tp is None else 0
        if chunk:
            fn = self.chunk_loss if rows is None else TokenLosses(labels.numel(), labels.device)
            with self.autocast:
                loss = run(head=LossHead(labels, chunk, fn))
            if rows is not None:
                self.source_losses.add(rows, fn.per_token, labels)
        else:
            with self.autocast:
                logits = run()  # (B, T, V)
            # Through the plan: with loss parallel the logits are sharded over the vocabulary.
            flat = logits.flatten(0, 1).float()
            if rows is not None:  # one cross-entropy: per token, then the mean of the valid
                per_token = self.cross_entropy(flat, labels.flatten(), reduction="none")
                loss = per_token.sum() / (labels != IGNORE_INDEX).sum().clamp(min=1)
                self.source_losses.add(rows, per_token.detach(), labels)
            else:
                loss = self.parallel.loss(self.cross_entropy, flat, labels.flatten())
        aux = self.model.pop_aux_loss()  # e.g. MoE balance losses
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
        return self.parallel.clip_grads(self.grad_clip)

    def global_stats(self, *, averaged: tuple[str, ...] = ("loss",),
                     **values: torch.Tensor | None) -> dict[str, float]:
        """Average the ``averaged`` values (the per-rank loss) over ranks, in one all-reduce;
        one host sync for everything."""
        keys = [k for k, v in values.items() if v is not None]
        packed = torch.stack([torch.as_tensor(values[k]).detach().float().to(self.device)
                              for k in keys])
        mean = [i for i, k in enumerate(keys) if k in averaged]
        if self.world.distributed and mean:
            at = torch.tensor(mean, device=packed.device)
            part = packed[at]
            distributed.all_reduce_(part)
            packed[at] = part / self.world.world_size
        return dict(zip(keys, packed.tolist(), strict=True))

    def guard_decision(self, stats: dict[str, float], segment: int) -> GuardDecision:
        if not self.guards:  # non-finite values stop the run (one clear error), never the weights
            return unguarded(stats, first=self.progress.step == 0 and segment == 0)
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
        self.model.on_optimizer_step(decision.skip)

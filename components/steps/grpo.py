"""The GRPO step: reinforcement learning with verifiable rewards on prompt data (``data.type =
"prompts"``, rewards in ``[rewards.NAME]``).

Each step: every rank samples ``group_size`` completions of each of its prompts (the
``rollout`` component: kiln's own generator, one seeded generator per completion), scores them
with the recipe's rewards, turns the weighted total into group advantages and takes
``iterations`` optimizer steps on the clipped objective (``grpo_loss.py``). The log-probabilities
come from the training forward (``ctx.token_logprobs`` with the sampling temperature): with one
iteration the "old" ones are that forward's, detached (the ratio is 1, the gradient the policy
gradient); with several they come from a no-gradient forward of the same code before the first
update. The generator's own log-probabilities only feed the ``rollout/logp_diff`` metric
(their mean absolute difference from the training forward's: 0 up to float rounding).

With ``beta > 0`` a KL term to a frozen reference (the starting weights sharded like the policy,
or the policy with its adapters off) joins the loss. ``dynamic_sampling`` leaves out of the loss
the groups whose rewards are all equal (DAPO): up to ``refill_rounds`` times it samples a
group for another prompt (drawn per slot of the global batch from the seed and the step, so the
same on any layout) in place of each such group, then drops those still equal.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field

from kiln.components import distributed
from kiln.components.base import ComponentConfig, Sub, component
from kiln.components.errors import DataError, RecipeError
from kiln.components.protocols import StepContext, StepContract, StepResult
from kiln.components.registry import register
from kiln.components.steps import grpo_batch, grpo_loss
from kiln.components.steps.common import (
    reference_logprobs,
    sequence_parallel_refusal,
    sharing_line,
)

Reference = Literal["auto", "frozen_copy", "adapters_off", "none"]


class GRPOStepConfig(ComponentConfig):
    rollout: Sub("rollout") = component("rollout", "kiln", "how completions are sampled "
                                        "(`kiln list rollout`)")
    group_size: int = Field(8, ge=2, description="completions per prompt (a group: the "
                            "advantages compare them)")
    epsilon: float = Field(0.2, gt=0, lt=1, description="lower clip of the ratio, 1 - epsilon")
    epsilon_high: float = Field(0.0, ge=0, description="upper clip, 1 + epsilon_high (DAPO's "
                                "clip-higher; 0 = epsilon)")
    beta: float = Field(0.0, ge=0, description="weight of the KL term to the reference "
                        "(0 = none, no reference model)")
    kl_correction: bool = Field(True, description="multiply the KL term by the ratio "
                                "(DeepSeek-V3.2's unbiased KL gradient; TRL's default)")
    reference: Reference = Field("auto", description='with beta > 0: "frozen_copy", '
                                 '"adapters_off", or "auto" (adapters_off with an [adapter])')
    loss_aggregation: grpo_loss.Aggregation = Field(
        "sequence", description='"sequence" (GRPO), "token" (DAPO), "constant" (Dr. GRPO: '
        "divided by completions x max_new_tokens)")
    scale_rewards: grpo_loss.Scale = Field(
        "group", description='divide the advantages by the group\'s reward std ("group"), the '
        'batch\'s ("batch") or not ("none": Dr. GRPO)')
    iterations: int = Field(1, ge=1, description="optimizer steps per rollout batch (μ)")
    dynamic_sampling: bool = Field(False, description="replace groups whose rewards are all "
                                   "equal with groups of other prompts (refill_rounds tries), "
                                   "and leave those still equal out of the loss (DAPO)")
    refill_rounds: int = Field(2, ge=0, description="with dynamic_sampling: rounds of sampling "
                               "replacement prompts for the equal groups (0 = only drop them)")
    overlong_filter: bool = Field(False, description="completions cut by max_new_tokens count "
                                  "no token in the loss (DAPO)")
    log_rollouts: int = Field(0, ge=0, description="every N steps write the step's completions "
                              "with their rewards to RUN/rollouts/ (0 = never)")
    share_prompts: bool = Field(
        True, description="compute each group's shared prompt once in the training forward "
        "(prefix sharing; the same values up to float rounding); models that cannot (Gated "
        "DeltaNet, MoE, dropout, compiled blocks) run the rows whole, as the start-up log says")


@register("step", "grpo")
class GRPOStep(StepContract):
    """Group-relative policy optimisation on sampled completions and rewards."""

    Config = GRPOStepConfig
    takes_pairs = "prompts"
    varying_width = True  # prompts and completions, cut and packed as they come
    trains_mtp = False  # scores the main head's log-probabilities

    def __init__(self, cfg: GRPOStepConfig) -> None:
        self.cfg = cfg
        self.rollout = cfg.rollout.build()
        self.rewards: dict = {}
        self.weights: list[float] = []  # each reward's (a plugin's config without one: 1)
        self.seed = 0
        self.reference: torch.nn.Module | None = None
        self.adapters_off = None
        self.dataset = self.run_dir = None
        self.rank, self.ranks = 0, 1

    @property
    def vocab(self) -> int:
        """The tokenizer's vocabulary: the rows the rollout samples from (and the log-softmax
        of training covers)."""
        return int(self.dataset.tokenizer.vocab_size)

    @property
    def epsilon_high(self) -> float:
        return self.cfg.epsilon_high or self.cfg.epsilon

    def check_recipe(self, recipe, layout) -> None:
        """Rewards build; whole sequences on every rank; no held-out loss (prompts have no
        targets: the in-loop tasks score the run)."""
        sequence_parallel_refusal("grpo", layout)
        if not recipe.rewards:
            raise RecipeError('training.step.type = "grpo" needs at least one reward: add a '
                              '[rewards.NAME] table with type = "exact_match", "numeric", '
                              '"format" or "length" (`kiln list reward`)')
        self.rewards = {}
        for name, cfg in recipe.rewards.items():
            try:
                self.rewards[name] = cfg.build()
            except ValueError as exc:
                raise RecipeError(f"rewards.{name}: {exc}") from None
        if recipe.eval.interval or recipe.eval.at_end:
            raise RecipeError('training.step.type = "grpo" trains on prompts, which have no '
                              "held-out loss: set eval.interval = 0 and eval.at_end = false, "
                              "and score the run with [evals.NAME] tasks")
        if self.cfg.beta and self.cfg.reference == "none":
            raise RecipeError('training.step.beta > 0 needs a reference: set '
                              'training.step.reference = "auto", "frozen_copy" or "adapters_off"')
        if self.cfg.beta and self.cfg.reference == "adapters_off" and recipe.adapter is None:
            raise RecipeError('training.step.reference = "adapters_off" needs an [adapter]')
        self.weights = [float(getattr(cfg, "weight", 1.0)) for cfg in recipe.rewards.values()]
        self.seed = recipe.training.seed

    def check_data(self, dataset) -> None:
        """Every reward's fields exist in the prompts; a prompt and its completion fit a row."""
        have = set(dataset.field_names)
        for name, reward in self.rewards.items():
            missing = [f for f in getattr(reward, "fields", ()) if f not in have]
            if missing:
                raise DataError(f"rewards.{name} reads the prompts' field {missing[0]!r}, "
                                f"{dataset.field_problem(missing[0])}; fix the data, set its "
                                "field, or map the data's with data.fields")
        checks = {n: r.check for n, r in self.rewards.items() if hasattr(r, "check")}
        for split in ("train", "eval") if checks else ():
            rows = list(range(dataset.prompt_count(split)))
            for row, fields in zip(rows, dataset.prompt_fields(split, rows), strict=True):
                for name, check in checks.items():
                    try:
                        check(fields)
                    except ValueError as exc:
                        raise DataError(f"rewards.{name} cannot score "
                                        f"{dataset.prompt_where(split, row)} ({exc}); fix that "
                                        "row, or choose another reward type") from None
        room = dataset.seq_len + 1 - self.rollout.max_new_tokens
        if dataset.longest_prompt > room:
            raise DataError(
                f"the longest prompt is {dataset.longest_prompt} tokens, and with "
                f"training.step.rollout.max_new_tokens = {self.rollout.max_new_tokens} it does "
                f"not fit training.seq_len = {dataset.seq_len} (+1); raise seq_len or lower "
                "max_new_tokens")

    def setup(self, build) -> None:
        self.dataset, self.run_dir = build.dataset, build.run_dir
        self.rank, self.ranks = build.rank, build.ranks
        self.check_data(build.dataset)
        if cut := getattr(self.rollout, "truncation", ""):  # as TRL's GRPOTrainer, said once
            build.lines.append(f"step: grpo samples with {cut}; the ratio, "
                               "KL, entropy and rollout/logp_diff use the whole distribution")
        if self.cfg.share_prompts:
            build.lines.append(sharing_line(
                build, "each group's prompt computed once per training forward", "rows"))
        if not self.cfg.beta:
            build.lines.append("step: grpo, no KL term (beta = 0): no reference model")
            return
        if self.cfg.reference in ("auto", "adapters_off"):
            self.adapters_off = build.without_adapters()
        if self.adapters_off is None:
            self.reference = build.frozen_model("initial")
        build.lines.append(f"step: grpo, KL to the reference (beta = {self.cfg.beta:g}), "
                           f"{'adapters_off' if self.adapters_off is not None else 'frozen_copy'}")

    # ------------------------------------------------------------------ the rollout
    def sample(self, ctx: StepContext, micro_batches) -> tuple[list, list, list, list[dict]]:
        """(prompts repeated per completion, samples, stored rows, the prompts' fields)."""
        prompts, rows = [], []
        for b in micro_batches:
            for ids, n, row in zip(b["prompt_ids"].tolist(), b["prompt_lengths"].tolist(),
                                   b["rows"].tolist(), strict=True):
                prompts.append(ids[:n])
                rows.append(row)
        repeated, samples = self.groups(ctx, prompts, rows)
        return repeated, samples, rows, self.dataset.prompt_fields("train", rows)

    def groups(self, ctx: StepContext, prompts: list[list[int]], rows: list[int],
               first_sample: int = 0) -> tuple[list, list]:
        """(each prompt repeated ``group_size`` times, a completion of each), the completions
        seeded by the stored rows and their places in the group from ``first_sample``."""
        g, ds = self.cfg.group_size, self.dataset
        seeds = [grpo_batch.completion_seed(self.seed, ctx.step, r, first_sample + j)
                 for r in rows for j in range(g)]
        repeated = [p for p in prompts for _ in range(g)]
        return repeated, self.rollout(
            ctx.model, repeated, seeds, decode=ds.decode, stops=ds.stop_strings,
            eos_id=ds.tokenizer.eos_id, pad_id=ds.pad_id, vocab_size=self.vocab,
            lockstep=distributed.is_initialized())

    def refill(self, ctx: StepContext, prompts, samples, rows, fields, values, total) -> int:
        """Replace, in place, groups whose rewards are all equal with groups sampled for other
        prompts; returns how many were replaced. Every rank samples as many groups per round as
        the rank needing the most (padding with its first prompt), so the ranks' forwards stay
        in step under FSDP2."""
        g, ds = self.cfg.group_size, self.dataset
        count, replaced = ds.prompt_count("train"), 0
        for round_ in range(self.cfg.refill_rounds):
            equal = grpo_loss.group_advantages(total, g, "none")[1][::g].tolist()
            need = [i for i, e in enumerate(equal) if e]
            most = torch.tensor([float(len(need))])
            distributed.all_reduce_(most, op="max")
            if not int(most):
                break
            slots = [self.rank * len(rows) + i for i in need]  # the global batch's slots
            picks = [grpo_batch.refill_row(self.seed, ctx.step, s, round_, count) for s in slots]
            picks += [rows[0]] * (int(most) - len(need))
            repeated, new = self.groups(ctx, ds.prompt_ids("train", picks), picks,
                                        first_sample=g * (round_ + 1))
            new_fields = ds.prompt_fields("train", picks)
            v, t = grpo_batch.score(self.rewards, self.weights, new[:len(need) * g],
                                    new_fields, g)
            still = grpo_loss.group_advantages(t, g, "none")[1][::g].tolist()
            for k, i in enumerate(need):
                if still[k]:
                    continue
                at, got = slice(i * g, (i + 1) * g), slice(k * g, (k + 1) * g)
                prompts[at], samples[at] = repeated[got], new[got]
                rows[i], fields[i] = picks[k], new_fields[k]
                values[at], total[at] = v[got], t[got]
                replaced += 1
        return replaced

    def reference_logprobs(self, ctx: StepContext, rows: grpo_batch.Rows) -> torch.Tensor:
        return reference_logprobs(ctx, rows.batch, self.reference, self.adapters_off,
                                  temperature=self.rollout.temperature, vocab=self.vocab,
                                  **self.shared(rows))

    def shared(self, rows: grpo_batch.Rows) -> dict[str, torch.Tensor]:
        """``token_logprobs``' ``groups`` of a micro-batch's rows: each ``group_size`` rows in
        turn share their prompt (a micro-batch holds whole groups when its rows are a
        multiple of the group; otherwise nothing is shared)."""
        n, g = rows.mask.shape[0], self.cfg.group_size
        if not self.cfg.share_prompts or n % g:
            return {}
        return {"groups": torch.arange(n).view(-1, g)}

    # ------------------------------------------------------------------ the step
    def __call__(self, ctx: StepContext, micro_batches) -> StepResult:
        cfg, g = self.cfg, self.cfg.group_size
        prompts, samples, rows, fields = self.sample(ctx, micro_batches)
        values, total = grpo_batch.score(self.rewards, self.weights, samples, fields, g)
        refilled = 0
        if cfg.dynamic_sampling and cfg.refill_rounds:
            refilled = self.refill(ctx, prompts, samples, rows, fields, values, total)
        batch_std = _global_std(total, ctx.device) if cfg.scale_rewards == "batch" else None
        adv, zero_std = grpo_loss.group_advantages(total, g, cfg.scale_rewards, batch_std)
        data = grpo_batch.training_rows(prompts, samples, self.dataset.pad_id, ctx.device,
                                        cfg.overlong_filter)
        if cfg.dynamic_sampling:
            data.mask &= ~zero_std.to(ctx.device)[:, None]
        adv = adv.to(ctx.device)
        kept = (data.mask.any(-1)).sum()
        counts = _all_sum(torch.stack([kept.double(), data.mask.sum().double()]), ctx.device)
        divisors = {"completions": max(float(counts[0]), 1.0) / self.ranks,
                    "tokens": float(counts[1]) / self.ranks,
                    "max_new_tokens": self.rollout.max_new_tokens}
        n = len(micro_batches)
        size = math.ceil(len(samples) / n)
        parts = [data.part(slice(i * size, (i + 1) * size)) for i in range(n)]
        refs = [self.reference_logprobs(ctx, p) for p in parts] if cfg.beta else [None] * n
        olds = [self._logprobs(ctx, p, grad=False) for p in parts] if cfg.iterations > 1 \
            else [None] * n
        # kl, low, high, tokens; |rollout - training log-prob| and its tokens (1st iteration)
        sums = torch.zeros(6, dtype=torch.float64, device=ctx.device)
        losses = []
        for it in range(cfg.iterations):
            ctx.zero_grad()
            loss_sum = torch.zeros((), device=ctx.device)
            for i, part in enumerate(parts):
                with ctx.grad_sync(i == n - 1):
                    logp = self._logprobs(ctx, part, grad=True)
                    old = logp.detach() if olds[i] is None else olds[i]
                    terms = grpo_loss.token_terms(
                        logp, old, adv[i * size:(i + 1) * size], epsilon=cfg.epsilon,
                        epsilon_high=self.epsilon_high, beta=cfg.beta, ref=refs[i],
                        kl_correction=cfg.kl_correction)
                    loss = grpo_loss.aggregate(terms.loss, part.mask, cfg.loss_aggregation,
                                               **divisors)
                    aux = ctx.model.pop_aux_loss()
                    (loss if aux is None else loss + (aux - aux.detach())).backward()
                loss_sum += loss.detach()
                m = part.mask
                sums += torch.stack([(terms.kl * m).sum() if terms.kl is not None
                                     else torch.zeros(()), (terms.low_clipped & m).sum(),
                                     (terms.high_clipped & m).sum(), m.sum(),
                                     *_rollout_diff(logp, part, first=it == 0)]).double()
            ctx.sync_grads()
            grad_norm = ctx.clip_grads()
            stats = ctx.global_stats(loss=loss_sum, grad_norm=grad_norm)
            decision = ctx.guard_decision(stats, segment=it)
            ctx.optimizer_step(decision, stats, segment=it, last_segment=it == cfg.iterations - 1)
            losses.append(stats["loss"])
            if decision.skip:
                break
        metrics = self.metrics(ctx, values, total, zero_std, prompts, samples, sums)
        if cfg.dynamic_sampling:
            metrics["refilled_groups"] = float(_all_sum(torch.tensor([float(refilled)]),
                                                        ctx.device)[0])
        if cfg.log_rollouts and (ctx.step + 1) % cfg.log_rollouts == 0:
            self.write_rollouts(ctx, prompts, samples, rows, values, total, adv)
        return StepResult(loss=losses[-1], tokens=int(metrics.pop("tokens")),
                          grad_norm=stats.get("grad_norm"), skipped=decision.skip,
                          reason=decision.reason, metrics=metrics)

    def _logprobs(self, ctx: StepContext, part: grpo_batch.Rows, grad: bool) -> torch.Tensor:
        with torch.set_grad_enabled(grad):
            logp = ctx.token_logprobs(part.batch, temperature=self.rollout.temperature,
                                      vocab=self.vocab, **self.shared(part))[0]
        if not grad:
            ctx.model.pop_aux_loss()
        return logp

    def metrics(self, ctx, values, total, zero_std, prompts, samples, sums
                ) -> dict[str, float]:
        """TRL's names, over the global batch (one all-reduce)."""
        lengths = torch.tensor([float(len(s.ids)) for s in samples])
        stats = [total.sum(), (total ** 2).sum(), torch.tensor(float(len(total))),
                 zero_std.float().sum(), lengths.sum(), torch.tensor(
                     float(sum(s.truncated for s in samples))),
                 torch.tensor(float(sum(sum(s.entropies) for s in samples))),
                 torch.tensor(float(sum(len(p) + len(s.ids)
                                        for p, s in zip(prompts, samples, strict=True))))]
        stats += [v for k in range(values.shape[1]) for v in (values[:, k].sum(),
                                                              (values[:, k] ** 2).sum())]
        first = 8  # the rewards' sums
        flat = _all_sum(torch.stack([torch.as_tensor(s, dtype=torch.float64) for s in stats]),
                        ctx.device).tolist()
        n = flat[2]
        out = {"reward": flat[0] / n, "reward_std": _std(flat[0], flat[1], n),
               "frac_reward_zero_std": flat[3] / n, "completions/mean_length": flat[4] / n,
               "completions/clipped_ratio": flat[5] / n, "entropy": flat[6] / max(flat[4], 1),
               "tokens": flat[7]}
        for k, name in enumerate(self.rewards):
            s, sq = flat[first + 2 * k], flat[first + 1 + 2 * k]
            out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = s / n, _std(s, sq, n)
        kl, low, high, tokens, diff, compared = _all_sum(sums, ctx.device).tolist()
        tokens = max(tokens, 1.0)
        out["rollout/logp_diff"] = diff / max(compared, 1.0)
        if self.cfg.beta:
            out["kl"] = kl / tokens
        out["clip_ratio/low_mean"], out["clip_ratio/high_mean"] = low / tokens, high / tokens
        out["clip_ratio/region_mean"] = (low + high) / tokens
        return out

    def write_rollouts(self, ctx, prompts, samples, rows, values, total, adv) -> None:
        names = list(self.rewards)
        records = [{"step": ctx.step + 1, "row": rows[i // self.cfg.group_size],
                    "prompt": self.dataset.decode(prompts[i]), "completion": s.text,
                    "tokens": len(s.ids), "truncated": s.truncated,
                    "rewards": dict(zip(names, values[i].tolist(), strict=True)),
                    "reward": float(total[i]), "advantage": float(adv[i])}
                   for i, s in enumerate(samples)]
        grpo_batch.write_log(self.run_dir / "rollouts" /
                             f"step_{ctx.step + 1:07d}-rank{self.rank}.jsonl", records)


def _rollout_diff(logp: torch.Tensor, part: grpo_batch.Rows, first: bool) -> list[torch.Tensor]:
    """[summed |training - rollout log-prob| over completion tokens, their count] on the first
    iteration (the weights the rollout sampled with), zeros after."""
    trained = part.batch["labels"] != grpo_batch.IGNORE_INDEX
    if not first:
        return [torch.zeros((), device=logp.device)] * 2
    return [((logp.detach() - part.sampled).abs() * trained).sum(), trained.sum()]


def _all_sum(t: torch.Tensor, device) -> torch.Tensor:
    t = t.to(device)
    distributed.all_reduce_(t)
    return t.cpu()


def _std(s: float, sq: float, n: float) -> float:
    """The unbiased standard deviation from a sum, a sum of squares and a count."""
    return math.sqrt(max(sq - s * s / n, 0.0) / (n - 1)) if n > 1 else 0.0


def _global_std(total: torch.Tensor, device) -> torch.Tensor:
    s, sq, n = _all_sum(torch.stack([total.sum(), (total ** 2).sum(),
                                     torch.tensor(float(len(total)))]).double(), device).tolist()
    return torch.tensor(_std(s, sq, n), dtype=total.dtype)

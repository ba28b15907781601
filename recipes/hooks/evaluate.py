"""Held-out loss in the loop (``[eval]``), and the evaluation that ``kiln eval`` shares."""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np
import torch

from kiln.components import distributed as dist_utils
from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.components.protocols import Hook
from kiln.components.tasks.common import STDERR
from kiln.recipes.runs import significance, unit_scores


class EvalHook(Hook):
    """Held-out loss every ``eval.interval`` steps and at the end, within a token budget."""

    priority = 60

    def on_step_end(self, trainer, result) -> None:
        cfg, step = trainer.recipe.eval, trainer.progress.step
        at_end = cfg.at_end and step == trainer.total_steps  # done once, by on_train_end
        if cfg.interval and step % cfg.interval == 0 and not at_end:
            self.evaluate(trainer)

    def on_train_end(self, trainer) -> None:
        if trainer.recipe.eval.at_end and not trainer.stop_requested:
            self.evaluate(trainer)

    def evaluate(self, trainer) -> float:
        names = list(trainer.dataset.source_names)
        units: dict[str, tuple[np.ndarray, list[str]]] = {}
        if names:
            loss, bpb, values, batches = evaluate_sources(trainer, names,
                                                          trainer.recipe.eval.tokens)
        else:
            own: dict[str, list[torch.Tensor]] = {}
            batches = evaluate_batches(trainer, trainer.recipe.eval.tokens, step_values=own)
            s, n = batches.sum(axis=0) if len(batches) else (0.0, 0.0)
            loss = s / n if n > 0 else float("nan")
            bpb, values = bits_per_byte(loss, trainer.dataset), step_means(trainer, own)
            units = step_units(trainer, own)  # every rank: a collective
        own_line = "  ".join(
            f"{k[5:]} {v:.4f}" + (f" ± {values[k + '_stderr']:.4f}" if k + "_stderr" in values
                                 else "")
            for k, v in values.items() if not k.startswith(("eval/loss/", "eval/bpb/"))
            and not k.endswith(("_stderr", "/examples", "/fingerprint")))
        # its noise: the standard error over the eval batches, and what was evaluated (runs
        # whose held-out sets differ do not compare: `kiln compare` checks the fingerprint)
        stderr = significance.ratio_stderr(batches[:, 0], batches[:, 1]) if len(batches) \
            else math.nan
        values.update({"eval/loss": loss, "eval/loss_stderr": stderr,
                       "eval/batches": len(batches), "eval/fingerprint": eval_fingerprint(trainer)})
        if bpb is not None:
            values["eval/bpb"] = bpb
        trainer.metrics.log(trainer.progress.step, values)
        trainer.last_eval_loss = loss
        if trainer.world.is_main:
            unit_scores.save(trainer.run_dir, unit_scores.LOSS, trainer.progress.step, batches,
                             ["loss_sum", "tokens"], task=False)
            for group, (scores, columns) in units.items():  # kiln compare pairs on these
                unit_scores.save(trainer.run_dir, group, trainer.progress.step, scores, columns)
            tail = f"  bpb {bpb:.4f}" if bpb is not None else ""
            per = "".join(f"  {k[10:]} {v:.4f}" for k, v in values.items()
                          if k.startswith("eval/loss/"))
            se = f" ± {stderr:.4f}" if math.isfinite(stderr) else ""
            trainer.print(f"eval  step {trainer.progress.step}  loss {loss:.4f}{se}"
                          f"  ppl {math.exp(min(loss, 50)):.2f}{tail}{per}")
            if own_line:  # the step's own held-out values (a preference step's rewards)
                trainer.print(f"eval  step {trainer.progress.step}  {own_line}")
        return loss


def eval_fingerprint(trainer) -> str:
    """What the held-out loss is taken over: the held-out split (each source's, the same for
    every training.seed), the token budget and how it is batched."""
    what = [trainer.dataset.eval_fingerprints(), trainer.recipe.eval.tokens,
            trainer.plan.seq_len, trainer.plan.micro_batch * trainer.data_ranks]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def evaluate_sources(trainer, names: list[str], token_budget: int
                     ) -> tuple[float, float | None, dict[str, float], np.ndarray]:
    """A mixture's held-out loss per source (``token_budget`` tokens of each): (loss over all
    the tokens evaluated, bits per byte over all their bytes or None, the per-source values
    ``eval/loss/NAME`` and ``eval/bpb/NAME``, every source's eval batches)."""
    values: dict[str, float] = {}
    loss_sum = tokens = bits = text_bytes = 0.0
    every = []
    for name in names:
        batches = evaluate_batches(trainer, token_budget, source=name)
        every.append(batches)
        s, n = batches.sum(axis=0) if len(batches) else (0.0, 0.0)
        loss = s / n if n else float("nan")
        values[f"eval/loss/{name}"] = loss
        loss_sum, tokens = loss_sum + s, tokens + n
        ratio = trainer.dataset.tokens_per_byte("eval", source=name)
        if ratio:
            values[f"eval/bpb/{name}"] = loss * ratio / math.log(2)
            bits, text_bytes = bits + s / math.log(2), text_bytes + n / ratio
        else:
            text_bytes = float("nan")  # one source without byte counts: no overall bpb
    bpb = bits / text_bytes if text_bytes and math.isfinite(text_bytes) else None
    return ((loss_sum / tokens if tokens else float("nan")), bpb, values,
            np.concatenate(every) if every else np.zeros((0, 2)))


def bits_per_byte(loss: float, dataset) -> float | None:
    """Bits per UTF-8 byte of the eval text: comparable across tokenizers, unlike the loss per
    token. ``loss`` (nats per token) times the eval split's tokens per byte, over ln 2; None
    when the dataset does not know its byte counts."""
    ratio = dataset.tokens_per_byte("eval")
    return loss * ratio / math.log(2) if ratio else None


def eval_sources(dataset) -> list[str | None]:
    """The eval splits to check and evaluate: a mixture's sources, or the one split (None)."""
    return list(dataset.source_names) or [None]


def eval_loader(trainer, source: str | None = None):
    """The eval split's loader of this rank (of one source of a mixture)."""
    return split_loader(trainer.dataset, trainer.plan.micro_batch, trainer.data_rank,
                        trainer.data_ranks, source)


def split_loader(dataset, micro_batch: int, rank: int, ranks: int, source: str | None = None):
    """The eval split's loader of data-parallel rank ``rank`` of ``ranks``: ``micro_batch`` rows
    per rank per batch (tensor-parallel peers share batches). The start-up checks build one
    too, so a split too small for one batch stops the run before step 1, not after the last."""
    extra = {} if source is None else {"source": source}
    return dataset.loader("eval", micro_batch=micro_batch, global_batch=micro_batch * ranks,
                          rank=rank, world_size=ranks, **extra)


def evaluate(trainer, token_budget: int) -> float:
    """Mean loss over the eval split's first ``token_budget`` tokens (all ranks together)."""
    s, n = evaluate_sums(trainer, token_budget)
    return s / n if n > 0 else float("nan")


def evaluate_sums(trainer, token_budget: int, source: str | None = None) -> tuple[float, float]:
    """(summed token loss, tokens) over the first ``token_budget`` eval tokens, all ranks."""
    batches = evaluate_batches(trainer, token_budget, source)
    return (float(batches[:, 0].sum()), float(batches[:, 1].sum())) if len(batches) \
        else (0.0, 0.0)


def step_means(trainer, own: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """``eval/NAME``: each of the step's own held-out values (``StepContract.evaluate``)
    averaged over the examples of all ranks (one all-reduce). A value the step names in
    ``scores`` (``GROUP/METRIC``) also gets ``eval/GROUP/METRIC_stderr`` (the mean's standard
    error over the examples), ``eval/GROUP/examples`` and ``eval/GROUP/fingerprint``, the
    fields of an in-loop task, so `kiln compare` judges it (paired on ``step_units``)."""
    if not own:
        return {}
    names = sorted(own)
    scored = [k for k in getattr(trainer.step_fn, "scores", ()) if k in own]
    values = {k: torch.cat(own[k]).double() for k in names}
    sums = torch.stack([values[k].sum() for k in names]
                       + [values[k].square().sum() for k in scored]
                       + [torch.tensor(float(len(values[names[0]])),
                                       dtype=torch.float64, device=trainer.device)])
    dist_utils.all_reduce_(sums)
    total = sums.tolist()
    n = total[-1]
    out = {f"eval/{k}": v / n for k, v in zip(names, total[:len(names)], strict=True)}
    for k, square in zip(scored, total[len(names):-1], strict=True):
        # tasks.common.mean_stderr's estimate (sample deviation / sqrt(n), NaN below two
        # examples), from the all-reduced sums instead of every rank's values
        mean = out[f"eval/{k}"]
        var = max(square - n * mean * mean, 0.0) / (n - 1) if n > 1 else math.nan
        group = k.rpartition("/")[0]
        out[f"eval/{k}{STDERR}"] = math.sqrt(var / n)
        out[f"eval/{group}/examples"] = n
        out[f"eval/{group}/fingerprint"] = eval_fingerprint(trainer)
    return out


def step_units(trainer, own: dict[str, list[torch.Tensor]]
               ) -> dict[str, tuple[np.ndarray, list[str]]]:
    """Per group of the step's scored values (``StepContract.scores``: ``rewards/accuracies``):
    every held-out example's values, (examples, metrics), in the eval stream's order, which is
    the same for 1 and N processes (global batch ``i`` holds rank 0's micro-batch ``i``, then
    rank 1's, ...). Saved beside the run (``unit_scores``) so that `kiln compare` pairs two runs
    example by example. Every rank takes part (one gather of the values)."""
    scored = [k for k in getattr(trainer.step_fn, "scores", ()) if k in own]
    if not scored:
        return {}
    local = {k: [t.double().cpu().tolist() for t in own[k]] for k in scored}
    everyone = dist_utils.all_gather_object((trainer.data_rank, local))
    # tensor-parallel peers hold the same data rank's values: one copy of each
    ranks = dict(sorted(everyone, key=lambda entry: entry[0]))
    out: dict[str, tuple[np.ndarray, list[str]]] = {}
    for k in scored:
        if len({len(r[k]) for r in ranks.values()}) != 1:  # not one stream: leave them unpaired
            return {}
        group, _, metric = k.rpartition("/")
        stream = [v for i in range(len(local[k])) for r in ranks.values() for v in r[k][i]]
        scores, columns = out.get(group, (np.zeros((len(stream), 0)), []))
        out[group] = (np.column_stack([scores, stream]), [*columns, metric])
    return out


@torch.no_grad()
def evaluate_batches(trainer, token_budget: int, source: str | None = None,
                     step_values: dict[str, list[torch.Tensor]] | None = None) -> np.ndarray:
    """(summed token loss, tokens) of every global eval batch (all ranks' micro-batches of
    it) over the first ``token_budget`` eval tokens: (batches, 2), the same on every rank.
    The batches are the units of the loss's standard error and of a paired comparison.
    ``step_values``: collects the step's own per-example values of each micro-batch
    (``StepContract.evaluate``)."""
    model = trainer.model
    was_training = model.training
    model.eval()
    loader = eval_loader(trainer, source)
    rows = []
    per_batch = trainer.plan.micro_batch * trainer.plan.seq_len * trainer.data_ranks
    for i, batch in enumerate(loader):
        if i * per_batch >= token_budget:
            break
        batch = trainer.to_device(batch)
        loss = trainer.forward_loss(batch)
        count = (batch["labels"] != IGNORE_INDEX).sum()  # masked data: its trained tokens
        if step_values is not None:
            for name, v in trainer.step_fn.evaluate(trainer.step_context, batch).items():
                step_values.setdefault(name, []).append(v.detach())
        rows.append(torch.stack([loss.double() * count, count.double()]))
    size = torch.tensor([len(rows)], dtype=torch.float64, device=trainer.device)
    dist_utils.all_reduce_(size, op="max")  # (ranks' loaders end together; in case not)
    total = torch.zeros(int(size.item()), 2, dtype=torch.float64, device=trainer.device)
    if rows:
        total[:len(rows)] = torch.stack(rows)
    dist_utils.all_reduce_(total)
    model.train(was_training)
    return total.cpu().numpy()

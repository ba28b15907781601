"""Masked data's loss: the mean over the global batch's trained tokens, whatever the split into
micro-batches (a mean of per-micro-batch means would weight a short answer like a long one)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.components.errors import TrainingAborted
from kiln.components.models.lm_head import IGNORE_INDEX
from kiln.components.steps.standard import StandardStep, StandardStepConfig
from tests.components.steps.trainer_stub import StubTrainer


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = torch.nn.Embedding(11, 8), torch.nn.Linear(8, 11)

    def forward(self, ids, **kw):
        return self.head(torch.tanh(self.emb(ids)))


def _rows() -> dict[str, torch.Tensor]:
    """4 rows with very different trained-token counts (1, 2, 7 and 12 of 12)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (4, 13), generator=g)
    labels = ids[:, 1:].clone()
    for row, keep in enumerate((1, 2, 7, 12)):
        labels[row, : 12 - keep] = IGNORE_INDEX
    return {"input_ids": ids[:, :-1], "labels": labels}


def _grads(micro: int) -> tuple[float, int, list[torch.Tensor]]:
    model = Tiny()
    ctx = StubTrainer(model, tokens_per_step=12)
    ctx.token_weighted, ctx.global_batch = True, 4
    rows = _rows()
    batches = [{k: v[i:i + micro] for k, v in rows.items()} for i in range(0, 4, micro)]
    ctx.zero_grad()
    total, trained = StandardStep(StandardStepConfig(type="standard")).accumulate(ctx, batches)
    return float(total), trained, [p.grad.clone() for p in model.parameters()]


def test_the_loss_is_the_mean_over_all_trained_tokens():
    loss, trained, _ = _grads(4)
    rows, model = _rows(), Tiny()
    with torch.no_grad():
        logits = model(rows["input_ids"]).flatten(0, 1)
    want = F.cross_entropy(logits, rows["labels"].flatten(), reduction="sum") / 22
    assert trained == 22 and loss == pytest.approx(want.item(), rel=1e-6)
    with torch.no_grad():
        mean_of_means = sum(F.cross_entropy(model(rows["input_ids"][i:i + 1]).flatten(0, 1),
                                            rows["labels"][i]) for i in range(4)) / 4
    assert abs(float(mean_of_means) - loss) > 1e-3  # the difference the weighting makes


def test_one_and_four_micro_batches_give_the_same_loss_and_gradients():
    one, four = _grads(4), _grads(1)
    assert one[0] == pytest.approx(four[0], rel=1e-6) and one[1] == four[1]
    for a, b in zip(one[2], four[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_pretraining_batches_keep_the_mean_of_means_bit_for_bit():
    model = Tiny()
    ctx = StubTrainer(model, tokens_per_step=12)
    rows = _rows()
    rows["labels"] = rows["input_ids"].roll(-1, 1)
    batches = [{k: v[i:i + 2] for k, v in rows.items()} for i in (0, 2)]
    total, trained = StandardStep.accumulate(ctx, batches)
    want = sum(ctx.forward_loss(b).detach() / 2 for b in batches)
    assert trained is None and torch.equal(total, torch.zeros(()) + want)


def test_a_micro_batch_with_nothing_to_train_on_is_a_clear_error():
    ctx = StubTrainer(Tiny(), tokens_per_step=12)
    ctx.token_weighted = True
    rows = _rows()
    rows["labels"][:2] = IGNORE_INDEX
    with pytest.raises(TrainingAborted, match="micro-batch 0 has no trained token"):
        StandardStep.accumulate(ctx, [{k: v[:2] for k, v in rows.items()},
                                      {k: v[2:] for k, v in rows.items()}])

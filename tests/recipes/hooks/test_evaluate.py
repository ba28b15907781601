"""The step's own held-out values (``StepContract.evaluate``): their means, and for the values
a step names in ``scores`` the fields of an in-loop task (standard error, example count,
fingerprint), which `kiln compare` then judges."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kiln.recipes.hooks.evaluate import step_means


def _trainer(scores):
    return SimpleNamespace(
        step_fn=SimpleNamespace(scores=scores), device=torch.device("cpu"),
        dataset=SimpleNamespace(eval_fingerprints=lambda: {"data": "abc"}),
        recipe=SimpleNamespace(eval=SimpleNamespace(
            tokens=1024)), plan=SimpleNamespace(seq_len=16, micro_batch=2), data_ranks=1)


def test_a_scored_value_gets_its_standard_error_count_and_fingerprint():
    hits = [torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, 1.0])]  # two micro-batches
    own = {"rewards/accuracies": hits, "rewards/margins": [torch.ones(3), torch.zeros(2)]}
    out = step_means(_trainer(("rewards/accuracies",)), own)
    p, n = 0.8, 5
    assert out["eval/rewards/accuracies"] == pytest.approx(p)
    assert out["eval/rewards/margins"] == pytest.approx(0.6)
    assert out["eval/rewards/accuracies_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / (n - 1)))
    assert out["eval/rewards/examples"] == n and len(out["eval/rewards/fingerprint"]) == 16
    assert "eval/rewards/margins_stderr" not in out  # not a score: no error bar, not judged
    plain = step_means(_trainer(()), own)
    assert set(plain) == {"eval/rewards/accuracies", "eval/rewards/margins"}


def test_the_scored_values_are_kept_in_the_eval_streams_order_over_ranks(monkeypatch):
    """Two ranks hold micro-batches [0, 1], [4, 5] (rank 0) and [2, 3], [6, 7] (rank 1) of two
    global batches: the stream of one process is 0..7. A tensor-parallel peer's copy of a data
    rank is taken once."""
    from kiln.components import distributed
    from kiln.recipes.hooks.evaluate import step_units

    def rank(values):
        return {"rewards/accuracies": [torch.tensor(v, dtype=torch.float32) for v in values],
                "rewards/margins": [torch.tensor(v, dtype=torch.float32) * 10 for v in values]}

    r0, r1 = rank([[0, 1], [4, 5]]), rank([[2, 3], [6, 7]])
    gathered = [(1, {k: [t.tolist() for t in v] for k, v in r1.items()}),
                (0, {k: [t.tolist() for t in v] for k, v in r0.items()}),
                (1, {k: [t.tolist() for t in v] for k, v in r1.items()})]
    monkeypatch.setattr(distributed, "all_gather_object", lambda obj: gathered)
    trainer = _trainer(("rewards/accuracies", "rewards/margins"))
    trainer.data_rank = 0
    (scores, columns), = step_units(trainer, r0).values()
    assert columns == ["accuracies", "margins"]
    assert scores[:, 0].tolist() == list(range(8)) and scores[:, 1].tolist() == [
        10 * v for v in range(8)]
    assert step_units(_trainer(()), r0) == {}  # nothing scored: nothing kept

"""`kiln eval`: loop-count parsing and the deeper-is-better verdict (the command itself runs on
a trained run in test_looped_moe_recipe.py)."""

from __future__ import annotations

import pytest
import torch

from kiln.components.errors import RecipeError
from kiln.recipes.commands.models.eval import parse_loops, verdict


@pytest.mark.parametrize("losses, better", [
    ([3.0, 2.9, 2.8], True),
    ([3.0, 3.0005, 2.5], True),  # a rise within the tolerance is noise
    ([3.0, 2.9995], False),  # a gain within the tolerance is no gain
    ([3.0, 3.1, 2.5], False),  # not monotone
    ([2.8, 3.0], False),
    ([3.0, 2.5, 2.5008, 2.5016], False),  # small rises that add up beyond the tolerance
])
def test_deeper_is_better_verdict(losses, better):
    assert verdict(losses)["deeper_is_better"] is better
    assert verdict([3.0])["deeper_is_better"] is None


def test_parse_loops():
    looped = torch.nn.Module()
    looped.loops = 8
    assert parse_loops("", looped) == [None]
    assert parse_loops("4, 1,2,2", looped) == [1, 2, 4]
    with pytest.raises(RecipeError, match="1..8"):
        parse_loops("1,9", looped)
    with pytest.raises(RecipeError, match="integers"):
        parse_loops("1,x", looped)
    with pytest.raises(RecipeError, match="looped model"):
        parse_loops("1", torch.nn.Linear(2, 2))


def test_a_document_masked_run_is_evaluated_with_its_mask():
    """`kiln eval` hands the run's document mask to the model, as training did."""
    import contextlib
    from types import SimpleNamespace

    import torch.nn.functional as F

    from kiln.components.attention.context import build_context
    from kiln.recipes.commands.models.eval import eval_loss
    from kiln.recipes.training.model_inputs import ModelInputs
    from tests.parallelisms.tiny import VOCAB, tiny_model

    model = tiny_model().eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    doc_ids = (torch.arange(16) >= 6).int().expand(2, -1)
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1), "doc_ids": doc_ids}
    masked = ModelInputs(SimpleNamespace(document_mask=True), torch.device("cpu"))
    got, n = eval_loss(model, [batch], 10**6, None, "cpu", contextlib.nullcontext(), masked)
    with torch.no_grad():
        want = F.cross_entropy(model(ids, context=build_context(16, doc_ids=doc_ids))
                               .flatten(0, 1), batch["labels"].flatten())
    assert n == 32 and got == pytest.approx(float(want), rel=1e-6)
    plain, _ = eval_loss(model, [batch], 10**6, None, "cpu", contextlib.nullcontext())
    assert plain != pytest.approx(got, rel=1e-6)  # the untrained model: a small difference


def test_eval_loss_of_masked_labels_is_the_mean_over_the_trained_tokens():
    """Chat data: `kiln eval` averages over the labels the loss is taken on, as training does."""
    import contextlib

    import torch.nn.functional as F

    from kiln.components.models.lm_head import IGNORE_INDEX
    from kiln.recipes.commands.models.eval import eval_loss
    from tests.parallelisms.tiny import VOCAB, tiny_model

    model = tiny_model().eval()
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, 1)
    labels[:, :10] = IGNORE_INDEX
    got, n = eval_loss(model, [{"input_ids": ids, "labels": labels}], 10**6, None, "cpu",
                       contextlib.nullcontext())
    with torch.no_grad():
        want = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())  # mean over valid
    assert n == 12 and got == pytest.approx(float(want), rel=1e-6)

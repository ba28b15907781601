"""`kiln eval`: loop-count parsing and the deeper-is-better verdict (the command itself runs on
a trained run in test_looped_moe_recipe.py)."""

from __future__ import annotations

import pytest
import torch

from kiln.components.errors import RecipeError
from kiln.recipes.commands.eval import parse_loops, verdict


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

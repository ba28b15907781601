"""NoPE: q and k pass through untouched, so one causal attention layer without positions sees
its prefix as a set: swapping two earlier tokens leaves the last position's logits as they were
(with RoPE they change, so the check can fail; deeper models see order through the mask)."""

from __future__ import annotations

import pytest
import torch

from kiln.components.positions.nope import NoPosition, NoPositionConfig
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS


def test_q_and_k_pass_through():
    q, k = torch.randn(2, 5, 4, 8), torch.randn(2, 5, 2, 8)
    got = NoPosition(NoPositionConfig(type="none"), head_dim=8, max_seq_len=16)(
        q, k, positions=torch.arange(5), limit=5)
    assert got[0] is q and got[1] is k


@pytest.mark.parametrize("position, order_matters", [("none", False), ("rope", True)])
def test_without_positions_the_prefix_is_a_set(position, order_matters):
    recipe = load_recipe(CONFIGS / "debug.toml", [
        "--model.dim=32", "--model.n_layers=1", "--model.attention.n_heads=2",
        f"--model.attention.position.type={position}"])
    torch.manual_seed(0)
    model = recipe.model.build(vocab_size=264, seq_len=16).eval()
    ids = torch.randint(0, 264, (1, 8), generator=torch.Generator().manual_seed(1))
    swapped = ids.clone()
    swapped[0, [1, 4]] = ids[0, [4, 1]]
    with torch.no_grad():
        a, b = model(ids)[0, -1], model(swapped)[0, -1]
    assert not torch.equal(ids, swapped)
    assert (not torch.allclose(a, b, atol=1e-5)) == order_matters

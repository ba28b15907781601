"""The identical-init check: fingerprints, and (slow, 2 processes) detection by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kiln.parallelisms.health.init_check import check_identical_init, fingerprint


def test_fingerprint_covers_parameters_buffers_and_the_rng():
    torch.manual_seed(0)
    model = nn.BatchNorm1d(4)
    names, values = fingerprint(model)
    assert names[:2] == ["weight", "bias"] and names[-1] == "<cpu rng state>"
    assert "running_mean" in names and values.shape == (len(names), 2)
    assert values.dtype == torch.float64


def test_fingerprint_changes_with_one_element_or_a_permutation():
    torch.manual_seed(0)
    a = nn.Linear(64, 64)
    _, base = fingerprint(a)
    with torch.no_grad():
        a.weight[0, 0] += 1e-3
    assert not torch.equal(fingerprint(a)[1][0], base[0])
    with torch.no_grad():
        a.weight[0, 0] -= 1e-3
        a.weight.copy_(a.weight.flip(0))  # same sum, other order: the weighted sum differs
    assert fingerprint(a)[1][0, 0].item() == pytest.approx(base[0, 0].item())
    assert fingerprint(a)[1][0, 1].item() != pytest.approx(base[0, 1].item())


def test_single_process_is_a_no_op():
    assert check_identical_init(nn.Linear(2, 2)) == "init check: single process"


@pytest.mark.slow
def test_two_ranks_detect_a_differing_weight_and_rng_state():
    from tests import nova_dist

    res = nova_dist.results()
    for rank in (res["init_check"], res["rank1"]["init_check"]):  # every rank raises
        assert rank["ok"].startswith("init check: ") and "identical on 2 ranks" in rank["ok"]
        assert "rank 1: mid.1.weight" in rank["caught"]
        assert "rank 1: <cpu rng state>" in rank["rng_caught"]

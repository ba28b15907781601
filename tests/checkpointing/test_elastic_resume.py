"""Elastic resume: a run continues on another number of processes or another mesh with the same
sample stream and its full state, and its losses from step k+1 on match the uninterrupted run
to rtol 1e-5 (the reduction order is the only difference).

For the dense debug recipe, the looped MoE recipe (segmented BPTT, carry on, MoE biases, spike
guard) and the Nova recipe (Muon + 8-bit AdamW): 2 -> 1 process, 1 -> 2 processes and HSDP
(2 x 1) -> FSDP 2, with micro_batch changes (the looped carry regrouped by global batch row)
and FSDP off on one side. One gloo spawn runs every 2-process part (``elastic_dist``).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.checkpointing import elastic_dist
from tests.checkpointing.elastic import K, N, eager, losses, train

FAMILIES = ("dense", "looped", "nova")
R21_EXTRA = {"dense": [], "looped": ["--training.micro_batch=1"], "nova": []}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    with eager():
        return _runs(tmp_path_factory.mktemp("elastic"))


def _runs(tmp):
    for name in elastic_dist.OPTIMIZERS:  # the optimizer cases, one-process side
        model, opt = elastic_dist.optimizer(name, shard=False)
        elastic_dist.train_steps(model, opt, 2)
        elastic_dist.dump_state(model, opt, tmp / f"{name}_one.safetensors")
        elastic_dist.save_state(model, opt, tmp / f"{name}_one", no_dist=True)
    outs = {}
    for family in FAMILIES:
        base = tmp / family
        train(family, base / "full1")
        train(family, base / "cut1", stop_after=K)
        shutil.copytree(base / "cut1", base / "r12")  # continued on 2 processes
    elastic_dist.run(tmp)
    for family in FAMILIES:
        base = tmp / family
        shutil.copytree(base / "cut2", base / "r21")
        outs[family] = train(family, base / "r21", *R21_EXTRA[family])
    for name in elastic_dist.OPTIMIZERS:
        model, opt = elastic_dist.optimizer(name, shard=False)
        elastic_dist.load_state(model, opt, tmp / f"{name}_two", no_dist=True)
        elastic_dist.dump_state(model, opt, tmp / f"{name}_two_on_one.safetensors")
    return tmp, outs


def _after_k(folder) -> list[float]:
    got = losses(folder)
    assert sorted(got) == list(range(1, N + 1)), sorted(got)
    return [got[s] for s in range(K + 1, N + 1)]


# (resumed run folder, uninterrupted reference, console text of the resumed part, must say)
CASES = {
    "2 -> 1 process": ("r21", "full2", None, ["resumed on a different layout", "2 processes",
                                              "RNG: not carried over"]),
    "1 -> 2 processes": ("r12", "full1", "r12.out", ["layout: 1 process -> 2 processes"]),
    "HSDP 2 x 1 -> FSDP 2": ("hsdp", "full2", "hsdp_fsdp.out",
                             ["dp_replicate=2 x dp_shard=1", "dp_replicate=1 x dp_shard=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("family", FAMILIES)
def test_resume_on_another_layout_continues_the_uninterrupted_run(runs, family, case):
    tmp, outs = runs
    base = tmp / family
    folder, reference, console, says = CASES[case]
    assert _after_k(base / folder) == pytest.approx(_after_k(base / reference), rel=1e-5)
    out = outs[family] if console is None else (base / console).read_text()
    for text in says:
        assert text in out, (text, out)


@pytest.mark.slow
def test_looped_carry_is_regrouped_by_global_batch_row(runs):
    tmp, outs = runs
    # 2 ranks x 1 slot of 2 rows -> 1 rank x 4 slots of 1 row (micro_batch 2 -> 1)
    assert "carry: 4 rows regrouped by global batch row from rank_00000.safetensors, " \
           "rank_00001.safetensors into 4 slots of 1" in outs["looped"]
    assert "carry: 2 rows regrouped" in (tmp / "looped" / "r12.out").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(elastic_dist.OPTIMIZERS))
def test_optimizer_state_reshards_exactly(runs, name):
    """One process and two ranks train to the same state (8-bit AdamW: the same blocks, bit for
    bit), and the state saved by either loads into the other unchanged (8-bit where it was)."""
    tmp, _ = runs
    one, two, one_on_two, two_on_one = (
        load_file(str(tmp / f"{name}_{n}.safetensors"))
        for n in ("one", "two", "one_on_two", "two_on_one"))
    assert sorted(one) == sorted(two) == sorted(one_on_two) == sorted(two_on_one)
    assert len([k for k in one if not k.endswith(".param")]) >= len(
        [k for k in one if k.endswith(".param")]), f"{name} keeps no state: vacuous"
    if name == "adamw8bit":  # the matrices are 8-bit on both layouts, the 1-D tensor fp32
        eight = sorted(k for k, v in one.items() if k.endswith("is8bit") and bool(v))
        assert eight == [f"{i}.{m}.is8bit" for i in range(3) for m in ("exp_avg", "exp_avg_sq")]
    if name == "adam_atan2":
        assert any(k.endswith(".ema") for k in one)
    for key in one:
        if name in ("adamw8bit", "sgd", "sign_sgd"):  # elementwise: the same bits on any layout
            assert torch.equal(one[key], two[key]), key
        else:  # Muon orthogonalises the gathered matrix; foreach kernels may fuse differently
            torch.testing.assert_close(one[key], two[key], rtol=1e-5, atol=1e-7)
        if not key.endswith(".param"):  # the loads restore optimizer state only
            assert torch.equal(two[key], two_on_one[key]), key
            assert torch.equal(one[key], one_on_two[key]), key


def test_every_shipped_optimizer_is_resharded_in_the_test():
    from kiln.components import registry

    assert set(elastic_dist.OPTIMIZERS) == set(registry.names("optimizer"))

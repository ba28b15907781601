"""adamw8bit (torchao): float LRs from the schedule, 8-bit state, close to fp32 AdamW, DCP."""

from __future__ import annotations

import pytest
import torch

from kiln.components.base import default_config
from kiln.components.optimizers.memory import optimizer_state_bytes
from tests import nova_dist
from tests.components.optimizers.helpers import dcp_round_trip


class Emb(torch.nn.Module):
    """One quantised tensor (64 x 128 = 8192 elements) and one small fp32-state tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(64, 128)
        self.scale = torch.nn.Parameter(torch.ones(128))

    def forward(self, x):
        return self.emb((x.abs() * 10).long() % 64).mean(1) * self.scale


def _groups(model, lr):
    return [{"params": list(model.parameters()), "lr": lr, "peak_lr": lr, "weight_decay": 0.1}]


def _train(model, opt, steps, lr_schedule=None):
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        if lr_schedule:
            for g in opt.param_groups:
                g["lr"] = g["peak_lr"] * lr_schedule(i)  # a float, as the trainer writes it
        x = torch.randn(8, 16, generator=gen)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.slow
def test_close_to_fp32_adamw_with_float_lrs_and_a_quarter_of_the_state():
    a, b = Emb(), Emb()
    opt8 = default_config("optimizer", "adamw8bit", lr=1e-2).build(_groups(a, 1e-2))
    opt32 = default_config("optimizer", "adamw", lr=1e-2).build(_groups(b, 1e-2))
    sched = lambda i: 0.5 + 0.1 * i  # noqa: E731
    _train(a, opt8, 5, sched)
    _train(b, opt32, 5, sched)
    assert float(opt8.param_groups[0]["lr"]) == pytest.approx(1e-2 * 0.9)
    moved = (b.emb.weight - Emb().emb.weight).abs().max().item()
    diff = (a.emb.weight - b.emb.weight).abs().max().item()
    assert diff < 0.05 * moved  # the 8-bit moments track the fp32 ones closely
    state = opt8.state[a.emb.weight]["exp_avg"]
    assert type(state).__name__ == "OptimState8bit"
    assert type(opt8.state[a.scale]["exp_avg"]) is torch.Tensor  # < 4096 elements: fp32
    # the matrix's moments: 2 x 8192 x (1 byte + 4/128 scale bytes: one block per 128-element
    # row), 0.26 of fp32's 2 x 8192 x 4 bytes
    moments = [opt8.state[a.emb.weight][k] for k in ("exp_avg", "exp_avg_sq")]
    assert [m.block_size for m in moments] == [128, 128]
    quantised = sum(m.codes.numel() * m.codes.element_size()
                    + m.scale.numel() * m.scale.element_size() for m in moments)
    assert quantised == 2 * 8192 * (1 + 4 / 128) < 0.27 * 2 * 8192 * 4
    # in all, with the 128-element vector's fp32 moments and the step counters
    assert optimizer_state_bytes(opt8) < 0.31 * optimizer_state_bytes(opt32)
    # compile = false: the same update run eagerly (fused differently: equal to rounding)
    c = Emb()
    _train(c, default_config("optimizer", "adamw8bit", lr=1e-2, compile=False).build(
        _groups(c, 1e-2)), 5, sched)
    assert (c.emb.weight - a.emb.weight).abs().max().item() < 1e-6 * a.emb.weight.abs().max()


@pytest.mark.slow  # imports torchao (seconds)
def test_compile_false_runs_the_update_without_compiling():
    from torch._dynamo.utils import counters

    emb = torch.nn.Parameter(torch.randn(64, 128))
    opt = default_config("optimizer", "adamw8bit", lr=1e-2, compile=False).build(
        [{"params": [emb], "lr": 1e-2, "peak_lr": 1e-2}])
    before = dict(counters["stats"])
    emb.grad = torch.randn_like(emb)
    start = emb.detach().clone()
    opt.step()
    assert dict(counters["stats"]) == before  # dynamo traced no frame
    assert type(opt.state[emb]["exp_avg"]).__name__ == "OptimState8bit"
    assert 0 < (emb - start).abs().max().item() <= 1.01e-2  # an Adam step moves by ~lr


@pytest.mark.slow
def test_dcp_round_trip(tmp_path):
    cfg = default_config("optimizer", "adamw8bit", lr=1e-2)
    assert dcp_round_trip(lambda m: cfg.build(_groups(m, cfg.lr)), tmp_path, make_model=Emb,
                          steps=2) == 0.0


@pytest.mark.slow
def test_fsdp2_state_round_trips_through_dcp():
    res = nova_dist.results()["adamw8bit"]
    assert res["dcp_round_trip"] == 0.0
    assert res["state_is_dtensor_of"] == "OptimState8bit"  # a DTensor wrapping the 8-bit state


@pytest.mark.parametrize("shape, block", [
    ((258, 128), 128), ((65, 128), 128), ((3, 4096), 256), ((6, 1408), 176), ((258, 32), 32),
    ((4, 16, 384), 256),  # an expert stack: a dim-0 row is 16 x 384 = 6144 elements
    ((64,), None), ((40, 100), None), ((2, 4099), None),  # 1-D, < 4096, no divisor >= 32
])
def test_blocks_never_cross_a_row_so_every_dim0_sharding_holds_the_same_blocks(shape, block):
    from kiln.components.optimizers.adamw8bit import state_layout

    assert state_layout(torch.empty(shape), 256) == block


@pytest.mark.slow
def test_a_matrix_whose_rows_are_shorter_than_a_block_is_still_8bit():
    emb = torch.nn.Parameter(torch.randn(258, 128))  # torchao alone: 8-bit on 1 process only
    # the layout is the subject, not the compiled update (a compile per shape: seconds here)
    opt = default_config("optimizer", "adamw8bit", lr=1e-2, compile=False).build(
        [{"params": [emb], "lr": 1e-2, "peak_lr": 1e-2}])
    emb.grad = torch.randn_like(emb)
    opt.step()
    state = opt.state[emb]["exp_avg"]
    assert type(state).__name__ == "OptimState8bit" and state.block_size == 128


def test_a_background_save_is_refused_with_the_reason():
    """dcp.async_save failed at the first checkpoint (after a step), its advice "free space
    there"; the recipe says why at once."""
    from kiln.components.errors import RecipeError
    from kiln.recipes.config.files import load_recipe
    from tests.conftest import CONFIGS

    with pytest.raises(RecipeError, match=r"checkpoint.async = true cannot save "
                                          r"optimizers.adamw.type = 'adamw8bit': .*OptimState8bit"):
        load_recipe(CONFIGS / "nova_debug.toml", ["--checkpoint.async=true"])
    load_recipe(CONFIGS / "nova_debug.toml", ["--checkpoint.async=true",
                                              "--checkpoint.enable=false"])


@pytest.mark.slow
def test_dcp_async_staging_still_cannot_copy_the_8bit_state(tmp_path):
    """Why the refusal above exists: when torch or torchao learns to copy the state, this fails
    and ``AdamW8bitConfig.async_save_problem`` can go."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    model = Emb()
    cfg = default_config("optimizer", "adamw8bit", lr=1e-2, compile=False)
    opt = cfg.build(_groups(model, cfg.lr))
    _train(model, opt, 1)
    state = {"optim": get_optimizer_state_dict(model, opt)}
    with pytest.raises(NotImplementedError, match="OptimState8bit"):
        dcp.async_save(state, checkpoint_id=str(tmp_path / "c"), no_dist=True).result()

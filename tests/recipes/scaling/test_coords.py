"""The µP coordinate check: flat under µP for the dense, differential-attention (Nova, Muon) and
MoE families, growing under the standard parametrization with AdamW; `kiln mup check` prints the
table, draws the PNG and names the layers that grow."""

from __future__ import annotations

import pytest

from kiln.recipes.cli import main
from kiln.recipes.scaling import coords as cc
from tests.conftest import CONFIGS

WIDTHS = [32, 64, 128]
SMALL = dict(steps=2, batch=2, seq_len=16)
ONE_LAYER = ["--model.n_layers=1"]
FAMILIES = {
    "dense": ("debug.toml", ["--model.base_dim=32"]),
    # head width 32 and two query heads per key/value head: widths of 64 and up
    "nova": ("nova_debug.toml", ["--model.base_dim=64", "--optimizers.muon.lr_scaling=spectral"]),
    "moe": ("debug.toml", ["--model.base_dim=32", "--model.ffn.type=moe",
                           "--model.ffn.n_experts=4", "--model.ffn.top_k=2"]),
}
# Under µP a layer's update may shrink a little with width at these tiny sizes, but never grow
# by more than this from width 32 to 128 (under the standard parametrization the logits' update
# grew x3 or more with AdamW).
FLAT = 1.5


@pytest.mark.parametrize("family", ["dense", "moe", pytest.param("nova", marks=pytest.mark.slow)])
def test_updates_are_flat_under_mup(family):
    recipe, overrides = FAMILIES[family]
    widths = [2 * w for w in WIDTHS] if family == "nova" else WIDTHS
    overrides = [*overrides, *ONE_LAYER]
    mup = cc.measure(str(CONFIGS / recipe), overrides, widths, parametrization="mup", **SMALL)
    assert set(mup.change) >= {"embedding", "layers.0.attention", "layers.0.feed_forward",
                               "norm", "logits"}
    assert cc.growing(mup, FLAT) == []
    if family != "nova":  # Muon's orthogonalised steps are nearly width-independent anyway
        sp = cc.measure(str(CONFIGS / recipe), overrides, widths, parametrization="standard",
                        **SMALL)
        assert sp.growth("logits") > 2.0 and dict(cc.growing(sp, FLAT))


def test_the_command_prints_the_table_draws_and_names_growing_layers(tmp_path, capsys):
    png = tmp_path / "coords.png"
    args = ["mup", "check", str(CONFIGS / "debug.toml"), "--widths", "32,64", "--steps", "1",
            "--batch", "2", "--seq-len", "16", "--out", str(png), "--model.base_dim=32",
            "--model.n_layers=1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[1].split()[:3] == ["layer", "mup", "d=32"]
    assert "every layer's update stays within x2.0" in out and png.stat().st_size > 10_000
    assert main([*args, "--factor", "0.1"]) == 1  # everything "grows" past a factor of 0.1
    err = capsys.readouterr().err
    assert "kiln mup check: logits grows x" in err and "not µP" in err
    assert "note:" not in err  # a pretraining recipe uses everything it names
    assert main([*args, "--checkpoint.init_from=runs/base", "--training.step.type=preference",
                 "--data.type=preference"]) == 0
    assert "kiln mup check: note: checkpoint.init_from = 'runs/base', training.step.type = " \
           "'preference' not used: the check trains the recipe's model and optimizers from " \
           "random weights" in capsys.readouterr().err
    assert main(["mup", "check", str(CONFIGS / "looped_moe_debug.toml")]) == 2
    assert "µP is implemented for the transformer family" in capsys.readouterr().err

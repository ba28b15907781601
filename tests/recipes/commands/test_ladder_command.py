"""`kiln ladder`: the size rule (depth, heads, FFN, budget, warmup) on several families, the
per-size recipes `kiln show` / `kiln diff` read, the messages for sizes the rule cannot make,
and one real ladder of tiny sizes: trained, rerun without retraining, continued after a kill,
fitted."""

from __future__ import annotations

import json
import math
import os

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.cli import main
from kiln.recipes.config.files import load_recipe
from kiln.recipes.loading.meta_model import build_meta_model
from kiln.recipes.scaling.ladder import plan
from tests import forked
from tests.conftest import CONFIGS

DEBUG = str(CONFIGS / "debug.toml")


def _values(point) -> dict[str, str]:
    return dict(point.values)


def test_the_size_rule_and_the_token_budget(tmp_path):
    points = plan(DEBUG, [], [128, 64], tmp_path, tokens_per_param=10)
    small, big = (_values(p) for p in points)  # smallest first
    assert [p.folder.name for p in points] == ["d64", "d128"]
    # debug: dim 256, 4 layers, 8 heads (width 32), hidden 768 (3x), warmup 20 of 300 steps
    assert (small["model.n_layers"], small["model.attention.n_heads"],
            small["model.ffn.hidden_dim"]) == ("1", "2", "192")
    assert (big["model.n_layers"], big["model.attention.n_heads"]) == ("2", "4")
    sized = load_recipe(DEBUG, points[1].overrides)
    n = build_meta_model(sized).num_params(exclude_embeddings=True)
    steps = int(big["training.steps"])
    assert steps == math.ceil(10 * n / (8 * 256))
    assert big["optimizer.schedule.warmup_steps"] == str(round(20 / 300 * steps))
    fixed = _values(plan(DEBUG, [], [64], tmp_path, depth="fixed")[0])
    assert "model.n_layers" not in fixed


def test_an_iso_flop_grid_gives_every_size_every_budget(tmp_path):
    points = plan(DEBUG, [], [64, 128], tmp_path, flops=[1e13, 3e13])
    assert [p.folder.name for p in points] == ["d64-C1e13", "d64-C3e13", "d128-C1e13",
                                               "d128-C3e13"]
    for p in points:
        sized = load_recipe(DEBUG, p.overrides)
        per_token = build_meta_model(sized).flops_per_token(256)
        c = float(p.folder.name.split("-C")[1])
        steps = sized.training.steps
        assert (steps - 1) * per_token * 2048 < c <= steps * per_token * 2048


def test_other_families_keep_their_shape(tmp_path):
    nova = plan(str(CONFIGS / "nova_debug.toml"), [], [64, 128], tmp_path)
    assert _values(nova[1])["model.attention.n_kv_heads"] == "2"  # 4 heads to 2, kept
    small = _values(nova[0])  # two optimizers: each one's warmup keeps its fraction
    assert small["optimizers.muon.schedule.warmup_steps"] == small[
        "optimizers.adamw.schedule.warmup_steps"] == str(round(int(small["training.steps"]) / 10))
    looped = plan(str(CONFIGS / "looped_moe_debug.toml"), [], [64], tmp_path)
    assert "model.n_layers" not in _values(looped[0])  # prelude / recurrent / coda kept
    assert _values(looped[0])["model.ffn.hidden_dim"] == "64"


@pytest.mark.parametrize("sizes, message", [
    ("48", "not a multiple of the base recipe's head width 32"),
    ("64,64", "positive numbers, each once"),
    ("64,x", "a comma-separated list of numbers"),
])
def test_sizes_the_rule_cannot_make(tmp_path, capsys, sizes, message):
    assert main(["ladder", DEBUG, "--sizes", sizes, "--plan", "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises(RecipeError, match="cannot keep the base ratio"):
        plan(str(CONFIGS / "nova_debug.toml"), [], [96], tmp_path)


def test_a_recipe_from_a_pretrained_model_is_refused_before_any_size(tmp_path, capsys):
    """dpo_debug starts from an SFT export: one width, which no other size can load."""
    out = tmp_path / "lad"
    assert main(["ladder", str(CONFIGS / "dpo_debug.toml"), "--sizes", "32,64", "--out",
                 str(out)]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.init_from = 'runs/sft_debug-export': a ladder trains every size" in err
    assert "--checkpoint.init_from=\"\"" in err and not out.exists()
    assert plan(str(CONFIGS / "dpo_debug.toml"), ['--checkpoint.init_from=""'], [32],
                tmp_path)  # from scratch it plans


def test_plan_writes_recipes_show_and_diff_read(tmp_path, capsys):
    out = tmp_path / "lad"
    assert main(["ladder", DEBUG, "--sizes", "64,128", "--plan", "--out", str(out)]) == 0
    assert "d64 " in capsys.readouterr().out and not (out / "d64").exists()  # nothing trained
    plan_file = json.loads((out / "ladder.json").read_text())
    assert plan_file["sizes"]["d64"][0] == "--model.dim=64"
    assert main(["show", str(out / "recipes" / "d128.toml")]) == 0
    assert "dim = 128" in capsys.readouterr().out
    assert main(["diff", str(out / "recipes" / "d64.toml"), str(out / "recipes" / "d128.toml")])
    diff = capsys.readouterr().out
    assert "dim: 64 -> 128" in diff and "n_heads: 2 -> 4" in diff
    assert main(["ladder", DEBUG, "--sizes", "64,128", "--flops", "1e13", "--emit", "slurm",
                 "--out", str(out)]) == 0
    script = (out / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-1" in script and "d128-C1e13" in script
    assert "submit: sbatch" in capsys.readouterr().out and not (out / "d64-C1e13").exists()


@pytest.mark.slow
def test_a_real_ladder_trains_resumes_and_fits(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NGPU"}
    tiny = ["--training.seq_len=32", "--training.global_batch=2", "--training.micro_batch=2",
            "--run.log_interval=1", "--eval.interval=0", "--eval.tokens=256",
            "--data.max_bytes=200000", "--checkpoint.enable=false", "--run.progress_bar=false"]
    args = ["kiln", "ladder", DEBUG, "--sizes", "32,64,96,128", "--tokens-per-param", "0.002",
            "--depth", "fixed", "--out", "lad", *tiny]
    done = forked.run(args, tmp_path, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "every size finished; fit it: kiln fit lad" in done.stdout
    first = (tmp_path / "lad" / "d32" / "metrics.jsonl").read_text()
    (tmp_path / "lad" / "d96" / "sweep_done.json").unlink()  # as if killed while it trained
    again = forked.run(args, tmp_path, env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("finished; skipped") == 3 and "d96" in again.stdout
    assert (tmp_path / "lad" / "d32" / "metrics.jsonl").read_text() == first
    fit = forked.run(["kiln", "fit", "lad", "--form", "params", "--bootstrap", "50", "--json"],
                     tmp_path, env)
    assert fit.returncode == 0, fit.stderr[-3000:]
    (lad,) = json.loads(fit.stdout)["ladders"]
    assert lad["points"] == 4 and lad["params"]["alpha"]["interval"] is not None

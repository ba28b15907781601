"""`kiln bench`: one JSON object with the documented keys, and the table."""

from __future__ import annotations

import json

from kiln.recipes.cli import main
from tests.conftest import CONFIGS
from tests.recipes.training.test_trainer import TINY

KEYS = ("tokens_per_second", "step_time_s", "mfu", "peak_memory_bytes", "time_to_first_step_s",
        "data_wait_s", "data_wait_fraction", "startup_s")


def test_bench_json_and_table(capsys):
    args = ["bench", str(CONFIGS / "debug.toml"), *TINY, "--steps", "2", "--warmup", "1"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in KEYS:
        assert key in result
    assert result["tokens_per_second"] > 0 and 0 < result["mfu"] < 1.5
    assert result["tokens_per_step"] == result["computed_tokens_per_step"] == 4 * 32
    assert result["optimizer_state_bytes"] == sum(result["optimizer_state_bytes_by_optimizer"]
                                                  .values()) > 0
    assert result["parallelism"] == "single process"
    phases = result["startup_s"]
    assert list(phases) == ["interpreter, imports", "recipe", "process group, run folder",
                            "health check", "data",
                            "model build", "parallelize", "optimizers, hooks", "first step"]
    assert all(v >= 0 for v in phases.values())
    assert sum(phases.values()) <= result["time_to_first_step_s"] + 1e-3
    assert 0 <= result["data_wait_s"] < result["step_time_s"]
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "tokens/s" in table and "time to first step" in table and "MFU" in table
    assert "data wait" in table and "model build" in table


def test_bench_takes_mfu_from_the_tokens_that_ran(capsys):
    """Unpacked chat rows run cut after their last label: MFU counts those columns, and the
    step-time line says how many ran (before, MFU counted the padding and read above 100%)."""
    from tests.recipes.training.test_padding_cut import UNPACKED

    args = ["bench", str(CONFIGS / "sft_debug.toml"), *UNPACKED, "--steps", "2", "--warmup", "1"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert 0 < result["computed_tokens_per_step"] < result["tokens_per_step"] == 8 * 256
    assert result["achieved_flops"] == result["flops_per_token"] * result[
        "computed_tokens_per_step"] / result["step_time_s"]
    assert main(args) == 0
    assert f"{result['tokens_per_step']:,} tokens/step, " in capsys.readouterr().out

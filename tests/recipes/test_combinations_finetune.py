"""Fine-tuning in the combination matrix (``test_combinations``): every family on ``chat`` data
(token-weighted, masked loss), with full weights, LoRA or DoRA, under every activation
checkpointing mode, and float8 with full weights: finite, and recomputation changes no loss.
An adapter with float8, and masked data with a step that cannot weight tokens, are refused with
one clear line. The 2-process FSDP2 runs (full, LoRA and DoRA: the 1-process losses) are in
``test_sft_recipe``."""

from __future__ import annotations

import math

import pytest

from kiln.components.errors import RecipeError
from kiln.recipes.config.files import load_recipe
from tests.conftest import CONFIGS
from tests.recipes.test_combinations import STEPS, TINY, ac_modes, discovered, train

CHAT = ("--data.type=chat", "--data.template=chatml", "--data.builtin_rows=200",
        "--training.seq_len=128", "--training.global_batch=2", "--training.micro_batch=1")
MODES = {"full": (), "lora": ("--adapter.rank=4", "--adapter.allow_random_base=true"),
         "dora": ("--adapter.type=dora", "--adapter.rank=4", "--adapter.allow_random_base=true")}


def chat_recipe(family: str, folder, *extra: str):
    file, overrides = discovered()[family]
    keep = [o for o in TINY if not o.startswith(("--data.", "--training.seq_len",
                                                 "--training.global_batch",
                                                 "--training.micro_batch"))]
    return load_recipe(CONFIGS / file, [*keep, *overrides, *CHAT, "--training.step.type=standard",
                                        f"--run.folder={folder}", *extra])


_reference: dict[tuple, list[float]] = {}


@pytest.mark.matrix
@pytest.mark.parametrize("family, mode, float8, ac", [
    pytest.param(f, m, f8, ac, id=f"{f}-{m}-f8_{f8}-{ac}") for f in discovered() for m in MODES
    for f8 in ("off", "rowwise") for ac in ac_modes()])
def test_fine_tuning_trains_in_every_combination(tmp_path, family, mode, float8, ac):
    args = [*MODES[mode], *ac_modes()[ac], f"--parallelism.float8={float8}"]
    if mode != "full" and float8 != "off":
        with pytest.raises(RecipeError, match=rf"\[adapter\] {mode}: not with parallelism.float8"):
            train(chat_recipe(family, tmp_path / "run", *args))
        return
    losses, trainer = train(chat_recipe(family, tmp_path / "run", *args))
    assert len(losses) == STEPS and all(map(math.isfinite, losses)), losses
    assert trainer.step_context.token_weighted
    key = (family, mode, float8)
    if key not in _reference:  # the "none" cell, first of its (family, mode, float8), is it
        _reference[key] = losses if ac == "none" else train(chat_recipe(
            family, tmp_path / "ref", *MODES[mode], *ac_modes()["none"],
            f"--parallelism.float8={float8}"))[0]
    assert losses == _reference[key]  # recomputation changes nothing

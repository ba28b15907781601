"""float8's two CPU paths in the combination matrix (``test_combinations``). The matrix trains
float8 emulated (``parallelism.float8_emulate = "auto"``, the CPU default: fp8 casts and scales,
float32 products); here every family trains with the fp8 kernel itself (``torch._scaled_mm``,
``float8_emulate = "off"``, what GPUs run) and gives the emulated run's losses to float32
rounding."""

from __future__ import annotations

import math

import pytest

from kiln.parallelisms.float8 import cpu_rowwise_scaled_mm
from tests.recipes.test_combinations import CELL, discovered, recipe_for, train


@pytest.mark.matrix
@pytest.mark.parametrize("family", list(discovered()))
def test_the_fp8_kernel_gives_the_emulated_losses_in_every_family(tmp_path, family):
    if not cpu_rowwise_scaled_mm():
        pytest.skip("this torch has no row-wise torch._scaled_mm on CPU (torch >= 2.13 has)")
    runs = {}
    for emulate in ("off", "auto"):
        recipe = recipe_for(family, tmp_path / emulate, *CELL, "--parallelism.float8=rowwise",
                            f"--parallelism.float8_emulate={emulate}")
        losses, trainer = train(recipe)
        assert trainer.parallel.float8_modules and all(map(math.isfinite, losses))
        assert trainer.parallel.float8_emulated == (emulate == "auto")
        runs[emulate] = losses
    assert runs["off"] == pytest.approx(runs["auto"], rel=1e-4)

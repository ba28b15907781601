"""Start-up cost: reading a recipe does not import FSDP2 / DTensor (kiln show, validate, diff
and the trainer's first phases stay light; torch._dynamo imports them later, for training)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import CONFIGS, REPO


@pytest.mark.slow
def test_loading_a_recipe_imports_no_fsdp_or_dtensor():
    code = (
        "import sys\n"
        "from kiln.recipes.config.files import load_recipe\n"
        f"load_recipe({str(CONFIGS / 'nova_debug.toml')!r})\n"
        "import kiln.parallelisms\n"
        "heavy = [m for m in ('torch.distributed.fsdp', 'torch.distributed.tensor') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]

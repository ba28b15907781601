"""scripts/bench_prepare.py runs at a small size, prints its table with the CPU model, and
deletes the corpus it generated."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.components.tokenizers.tokenizer_files import trained_tokenizer
from tests.conftest import REPO


@pytest.mark.slow
def test_bench_prepare_small(tmp_path):
    tok = trained_tokenizer(tmp_path / "tok", vocab_size=300)
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_prepare.py"),
                          "--size-mb", "1", "--workers", "1", "--tokenizer", str(tok),
                          "--tmp", str(work)], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("CPU: ") and "corpus 1 MB of text" in lines[0]
    assert "encode_batch_fast" in lines[2] and "kiln data prepare --workers 1" in lines[3]
    assert float(lines[3].split()[5]) > 0  # MB/s
    assert not list(work.iterdir())  # the corpus and outputs are gone

"""Shared fixtures: recipes written into temp folders, a clean registry per test."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "train_configs"

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture
def write(tmp_path):
    """write("name.toml", text) -> path of a dedented TOML file in tmp_path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
        return path

    return _write


@pytest.fixture(autouse=True)
def _kiln_cache(tmp_path_factory, monkeypatch):
    """Prepared datasets go to one session-wide temp cache, never the user's home."""
    cache = tmp_path_factory.getbasetemp() / "kiln-cache"
    monkeypatch.setenv("KILN_CACHE", str(cache))

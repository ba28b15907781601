"""torchao is imported with its start-up warnings hushed, and logger levels are restored."""

from __future__ import annotations

import logging

from kiln.components.torchao_import import import_torchao, quiet_loggers


def test_quiet_loggers_restores_levels():
    lg = logging.getLogger("kiln-test-quiet")
    lg.setLevel(logging.INFO)
    with quiet_loggers("kiln-test-quiet"):
        assert lg.level == logging.ERROR
    assert lg.level == logging.INFO


def test_import_torchao_returns_the_module():
    assert hasattr(import_torchao("torchao.optim"), "AdamW8bit")

"""Import torchao without its start-up noise.

torchao logs a warning for every optional CUDA extension it cannot load and trips a torch
deprecation warning on import; on a CPU machine that is several lines of alarm about nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from types import ModuleType


@contextlib.contextmanager
def quiet_loggers(*names: str):
    """Raise the given loggers to ERROR for the duration of the block."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def import_torchao(module: str = "torchao") -> ModuleType:
    """``importlib.import_module(module)`` (a torchao module) with its import warnings hushed."""
    with quiet_loggers("torchao", "torch.utils._pytree"):
        return importlib.import_module(module)

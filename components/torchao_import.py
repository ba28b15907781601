"""Import torchao, and compile, without their start-up noise.

torchao logs a warning for every optional CUDA extension it cannot load and trips a torch
deprecation warning on import; on a CPU machine that is several lines of alarm about nothing.
torch.compile's first use adds two more that no kiln user can act on (``quiet_compile``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import warnings
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


def quiet_compile() -> None:
    """Call before kiln compiles anything (model blocks, the loss, torchao's 8-bit optimizer
    step). Inductor's first import loads ``torch.utils.mkldnn``, whose classes still use
    ``torch.jit.script_method``, deprecated by torch 2.13 itself (a warning per method): load
    it here with that one warning ignored. And torchao 0.18's 8-bit optimizer state
    (``OptimState8bit``) lacks ``_stable_hash_for_caching``, so AOT autograd skips caching its
    graph and says so while compiling the step: that message is ignored for the process
    (re-applied on every call, so it holds where a test harness resets warning filters)."""
    if "torch.utils.mkldnn" not in sys.modules:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.script_method` is deprecated",
                                    category=DeprecationWarning)
            importlib.import_module("torch.utils.mkldnn")
    warnings.filterwarnings("ignore", message="OptimState8bit does not implement "
                            "_stable_hash_for_caching", category=UserWarning)

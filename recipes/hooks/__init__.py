"""Hooks: the work around the step, one per module, each with its config.

The base class and its events are ``kiln.components.protocols.Hook`` (re-exported here). The
hooks with a ``[run.*]`` table register under kind ``hook``; the registry imports them on first
use through ``import_builtins``.
"""

from __future__ import annotations

import importlib

from kiln.components.protocols import Hook

__all__ = ["Hook", "import_builtins"]

BUILTINS: tuple[str, ...] = (
    "kiln.recipes.hooks.watchdog",
    "kiln.recipes.hooks.diagnostics",
    "kiln.recipes.hooks.routing",
    "kiln.recipes.hooks.profiling",
    "kiln.recipes.hooks.plot",
)


def import_builtins() -> None:
    for name in BUILTINS:
        importlib.import_module(name)

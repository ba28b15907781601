"""Hooks: the work around the step, one per module, each with its config.

The base class and its events are ``kiln.components.protocols.Hook`` (re-exported here). The
hooks with a ``[run.*]`` table register under kind ``hook``; the registry imports them on first
use.
"""

from __future__ import annotations

from kiln.components.protocols import Hook

__all__ = ["BUILTINS", "Hook"]

BUILTINS: tuple[str, ...] = (
    "kiln.recipes.hooks.watchdog",
    "kiln.recipes.hooks.diagnostics",
    "kiln.recipes.hooks.routing",
    "kiln.recipes.hooks.profiling",
    "kiln.recipes.hooks.plot",
)


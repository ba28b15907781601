"""kiln's registered components, one per module. Importing a module registers what it defines.

``BUILTINS`` lists the modules the registry imports on first use; third-party components come
through the ``kiln.components`` entry-point group instead.
"""

from __future__ import annotations

import importlib

BUILTINS: tuple[str, ...] = (
)


def import_builtins() -> None:
    for name in BUILTINS:
        importlib.import_module(name)

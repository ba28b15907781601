"""What the test forkserver (``tests/forked.py``) imports of kiln before it forks: the command
line, the trainer and every built-in component module, about 2 s of imports and pydantic class
building that each forked kiln command or gloo rank would otherwise repeat; and what compiled and
float8 runs load on first use (inductor ~1.8 s, torchao's float8 ~0.3 s), through kiln's own
quiet import paths.

Nothing here reads the environment or a cache at import (kiln reads ``KILN_CACHE``, ``HF_*``
and the rank variables when it runs), and no plugin entry point is loaded: a child still finds
plugins installed after the server started."""

import importlib

from kiln.components import registry
from kiln.components.torchao_import import import_torchao, quiet_compile
from kiln.recipes import cli  # noqa: F401
from kiln.recipes.commands import train  # noqa: F401
from kiln.recipes.training import trainer  # noqa: F401

for package in registry.BUILTIN_PACKAGES:  # what registry.ensure_loaded imports first
    for name in importlib.import_module(package).BUILTINS:
        importlib.import_module(name)

import_torchao("torchao.float8")
quiet_compile()
importlib.import_module("torch._inductor.compile_fx")

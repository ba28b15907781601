"""The component registry: every buildable piece of a recipe is registered here by name.

This is a leaf module: it imports nothing else from kiln, so any module may import it without
cycles. Built-in components register themselves with ``@register(kind, name)`` where they are
defined (the ``components`` package imports them all); third-party packages add theirs through
the ``kiln.components`` entry-point group, loaded lazily and once.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import threading
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any

ENTRY_POINT_GROUP = "kiln.components"

# The kinds a recipe can name. Plugins may register new kinds too; these are documented ones.
KINDS = (
    "model",
    "attention",
    "ffn",
    "norm",
    "position",
    "optimizer",
    "schedule",
    "dataset",
    "tokenizer",
    "guard",
    "step",
    "preference_loss",
    "reward",
    "rollout",
    "logger",
    "task",
    "hook",
    "adapter",
)

# The packages whose import registers kiln's built-in components, imported by name on first use
# (as entry points are), so this leaf imports nothing of kiln. Hooks live on the top floor.
BUILTIN_PACKAGES = ("kiln.components", "kiln.components.adapters", "kiln.recipes.hooks")


class RegistryError(Exception):
    """A registration or lookup problem; the message says what is wrong and what is valid."""


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    obj: Any
    config: type
    origin: str  # "module:qualname" of the definition, for duplicate errors and `kiln list`

    @property
    def doc(self) -> str:
        text = inspect.getdoc(self.obj) or ""
        return text.strip().splitlines()[0] if text.strip() else ""


_entries: dict[tuple[str, str], Entry] = {}
_builtins_loaded = False
_plugins_loaded = False
# Held while the built-ins or the plugins load: a second thread's first lookup (a data loader's,
# a script's thread pool) waits for the whole loading instead of seeing it half done. Re-entrant:
# a module being loaded may look up a component in the same thread.
_loading = threading.RLock()


def _origin(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', repr(obj))}"


def register(kind: str, name: str, config: type | None = None):
    """Register ``obj`` (a class or factory) as component ``name`` of ``kind``.

    ``config`` is the component's typed config class; by default ``obj.Config``. The object is
    built as ``obj(cfg, **context)`` where ``context`` holds what the parent passes in.
    """

    def decorator(obj: Any) -> Any:
        cfg_cls = config if config is not None else getattr(obj, "Config", None)
        if cfg_cls is None:
            raise RegistryError(
                f"component {kind}:{name} ({_origin(obj)}) has no config: give it a nested "
                "`Config` class or pass `config=` to @register"
            )
        entry = Entry(kind, name, obj, cfg_cls, _origin(obj))
        old = _entries.get((kind, name))
        if old is not None and old.origin != entry.origin:
            raise RegistryError(
                f"duplicate component {kind}:{name!r}: defined by {old.origin} and again by "
                f"{entry.origin}; rename one of them"
            )
        _entries[(kind, name)] = entry
        return obj

    return decorator


def unregister(kind: str, name: str) -> None:
    """Remove a registration (tests use this to clean up)."""
    _entries.pop((kind, name), None)


def _load_builtins() -> None:
    global _builtins_loaded
    with _loading:
        if not _builtins_loaded:
            _builtins_loaded = True
            # Each package lists its built-in modules itself, in ``BUILTINS``.
            for package in BUILTIN_PACKAGES:
                for name in importlib.import_module(package).BUILTINS:
                    importlib.import_module(name)


def load_plugins(force: bool = False) -> list[str]:
    """Import every ``kiln.components`` entry point once; return warnings for failed ones.

    A value naming a module is imported (its ``@register`` calls do the work); a value naming a
    callable is imported and called with no arguments. A broken plugin warns, naming its
    distribution, and does not stop runs that do not use it.
    """
    global _plugins_loaded
    with _loading:
        if _plugins_loaded and not force:
            return []
        _plugins_loaded = True
        return _load_entry_points()


def _load_entry_points() -> list[str]:
    problems = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist is not None else "<unknown distribution>"
        try:
            loaded = ep.load()
            if callable(loaded) and not inspect.ismodule(loaded):
                loaded()
        except Exception as exc:  # a plugin's own bug must not break unrelated runs
            msg = (
                f"kiln plugin {ep.name!r} from distribution {dist!r} failed to load "
                f"({type(exc).__name__}: {exc}); its components are unavailable"
            )
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            problems.append(msg)
    return problems


def ensure_loaded() -> None:
    _load_builtins()
    load_plugins()


def kinds() -> list[str]:
    ensure_loaded()
    return sorted(set(KINDS) | {k for k, _ in _entries})


def names(kind: str) -> list[str]:
    ensure_loaded()
    return sorted(n for k, n in _entries if k == kind)


def did_you_mean(word: str, choices: list[str]) -> str:
    """The hint after an unknown name: the closest choice, and a second one nearly as close
    (``stepz``: 'step' or 'steps'); empty when nothing is close."""
    close = difflib.get_close_matches(word, choices, n=2, cutoff=0.5)
    if not close:
        return ""
    also = [c for c in close[1:] if difflib.SequenceMatcher(None, word, c).ratio() >= 0.75]
    return f" (did you mean {' or '.join(repr(c) for c in close[:1] + also)}?)"


def get(kind: str, name: str) -> Entry:
    ensure_loaded()
    entry = _entries.get((kind, name))
    if entry is None:
        valid = names(kind)
        if not valid and kind not in kinds():
            raise RegistryError(f"unknown component kind {kind!r}; kinds: {', '.join(kinds())}")
        if not valid:
            raise RegistryError(f"no {kind} component is registered (looked for {name!r})")
        raise RegistryError(
            f"unknown {kind} {name!r}; valid: {', '.join(valid)}{did_you_mean(name, valid)}"
        )
    return entry


def for_config(cfg: Any) -> Entry:
    """The registration that a config instance builds: its class and its ``type`` name."""
    ensure_loaded()
    for entry in _entries.values():
        if entry.name == getattr(cfg, "type", None) and isinstance(cfg, entry.config):
            return entry
    name = getattr(cfg, "type", None)
    raise RegistryError(f"no component named {name!r} uses {type(cfg).__name__}")


def entries(kind: str | None = None) -> list[Entry]:
    ensure_loaded()
    return sorted(
        (e for e in _entries.values() if kind is None or e.kind == kind),
        key=lambda e: (e.kind, e.name),
    )

"""kiln's one exception hierarchy: every message says what is wrong, what is valid and what to do.

The command line prints ``KilnError`` messages without a traceback; ``RecipeError`` (a bad
recipe or command line), ``CheckpointError``, ``TrainingAborted`` and ``RunFolderInUse`` exit
with status 2, ``TrainingHung`` (the hang watchdog) with 3, the others with status 1.

A leaf module: every package may import it and it imports nothing of kiln.
"""

from __future__ import annotations


class KilnError(Exception):
    """Base of kiln's user-facing errors."""

    exit_code = 1


class RecipeError(KilnError):
    """A malformed recipe, override or command line."""

    exit_code = 2


class DataError(KilnError):
    """A missing, corrupt or mismatched dataset folder."""


class CheckpointError(KilnError):
    """A missing, corrupt, tampered or incompatible checkpoint."""

    exit_code = 2


class TrainingAborted(KilnError):
    """A guard aborted training (loss spikes, too many skipped steps)."""

    exit_code = 2


class RunFolderInUse(KilnError):
    """Another live run holds the run folder (``recipes/runs/lock.py``)."""

    exit_code = 2


class HealthCheckFailed(KilnError):
    """A collective, a device or a link failed the start-up health check."""


class TrainingHung(KilnError):
    """A step made no progress for longer than the hang watchdog's threshold. Its own status,
    so that a scheduler script can requeue the run on it."""

    exit_code = 3

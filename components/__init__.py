"""kiln's registered components, one per module. Importing a module registers what it defines.

``BUILTINS`` lists the modules the registry imports on first use; third-party components come
through the ``kiln.components`` entry-point group instead.
"""

from __future__ import annotations

import importlib

BUILTINS: tuple[str, ...] = (
    "components.optimizers.adamw",
    "components.optimizers.adamw8bit",
    "components.optimizers.adam_atan2",
    "components.optimizers.muon",
    "components.optimizers.sgd",
    "components.schedules.warmup_cosine",
    "components.schedules.wsd",
    "components.schedules.constant",
    "components.steps.standard",
    "components.steps.segmented_bptt",
    "components.norms.rmsnorm",
    "components.positions.rope",
    "components.attention.causal",
    "components.attention.differential",
    "components.ffn.swiglu",
    "components.ffn.moe",
    "components.guards.spike_guard",
    "components.models.transformer",
    "components.models.looped",
    "components.data.byte_tokenizer",
    "components.data.packed_documents",
    "components.data.balanced_shards",
)


def import_builtins() -> None:
    for name in BUILTINS:
        importlib.import_module(name)

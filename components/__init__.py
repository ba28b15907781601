"""kiln's registered components, one per module. Importing a module registers what it defines.

``BUILTINS`` lists the modules the registry imports on first use; third-party components come
through the ``kiln.components`` entry-point group instead.
"""

from __future__ import annotations

BUILTINS: tuple[str, ...] = (
    "kiln.components.optimizers.adamw",
    "kiln.components.optimizers.adamw8bit",
    "kiln.components.optimizers.adam_atan2",
    "kiln.components.optimizers.muon",
    "kiln.components.optimizers.sgd",
    "kiln.components.schedules.warmup_cosine",
    "kiln.components.schedules.wsd",
    "kiln.components.schedules.constant",
    "kiln.components.steps.standard",
    "kiln.components.steps.segmented_bptt",
    "kiln.components.steps.preference_losses",
    "kiln.components.steps.preference",
    "kiln.components.steps.grpo",
    "kiln.components.rewards.builtin",
    "kiln.components.rollouts.kiln_generator",
    "kiln.components.norms.rmsnorm",
    "kiln.components.norms.layernorm",
    "kiln.components.positions.rope",
    "kiln.components.positions.nope",
    "kiln.components.attention.causal",
    "kiln.components.attention.differential",
    "kiln.components.attention.latent",
    "kiln.components.attention.gated_deltanet",
    "kiln.components.ffn.swiglu",
    "kiln.components.ffn.mlp",
    "kiln.components.ffn.moe",
    "kiln.components.guards.spike_guard",
    "kiln.components.models.transformer",
    "kiln.components.models.looped",
    "kiln.components.tokenizers.byte_tokenizer",
    "kiln.components.tokenizers.hf_tokenizer",
    "kiln.components.tokenizers.bpe_tokenizer",
    "kiln.components.tokenizers.sentencepiece_tokenizer",
    "kiln.components.tokenizers.tiktoken_tokenizer",
    "kiln.components.data.packed_documents",
    "kiln.components.data.balanced_shards",
    "kiln.components.data.streaming_text",
    "kiln.components.data.mixture.dataset",
    "kiln.components.data.chat.dataset",
    "kiln.components.data.preference.dataset",
    "kiln.components.data.prompts.dataset",
    "kiln.components.tasks.multiple_choice",
    "kiln.components.tasks.exact_match",
    "kiln.components.tasks.bits_per_byte",
)


"""RoPE between a Hugging Face config (``rope_parameters`` of transformers 5, or the older
``rope_theta`` + ``rope_scaling``) and kiln's ``position`` table, for every family."""

from __future__ import annotations

from typing import Any

from kiln.components.errors import CheckpointError

ROPE_TYPES = {"default": "none", "linear": "linear", "llama3": "llama3", "yarn": "yarn"}
ROPE_FIELDS = {  # Hugging Face rope parameter -> kiln rope field
    "factor": "factor", "original_max_position_embeddings": "original_max_seq_len",
    "low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
    "beta_fast": "beta_fast", "beta_slow": "beta_slow", "attention_factor": "attention_factor",
    "truncate": "yarn_truncate",
}


def fail(source: str, field: str, problem: str, fix: str = "") -> CheckpointError:
    hint = f"; {fix}" if fix else ""
    return CheckpointError(f"{source}: config.json field {field!r}: {problem}{hint}")


def rope_table(config: dict, source: str) -> dict[str, Any]:
    """The kiln ``position`` table of the config's RoPE (``rope_parameters`` of transformers 5,
    or the older ``rope_theta`` + ``rope_scaling``)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    key = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    theta = params.pop("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise fail(source, f"{key}.rope_type", f"{rope_type!r} is not supported",
                   f"kiln supports {', '.join(ROPE_TYPES)}")
    table: dict[str, Any] = {"type": "rope", "theta": float(theta)}
    if rope_type != "default":
        table["scaling"] = ROPE_TYPES[rope_type]
    for name, value in params.items():
        if value is None:
            continue
        if name == "partial_rotary_factor" and value == 1.0:
            continue
        if name not in ROPE_FIELDS or rope_type == "default":
            raise fail(source, f"{key}.{name}", f"not supported with rope_type {rope_type!r}")
        table[ROPE_FIELDS[name]] = bool(value) if name == "truncate" else (
            int(value) if name == "original_max_position_embeddings" else float(value))
    if rope_type == "yarn" and "factor" not in table:
        raise fail(source, f"{key}.factor", "yarn without a factor is not supported")
    return table


def rope_parameters(rope: Any) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` of a kiln RoPE config (``rope_table``'s inverse;
    partial RoPE's ``partial_rotary_factor`` is the families' own)."""
    params: dict[str, Any] = {"rope_type": "default" if rope.scaling == "none" else rope.scaling,
                              "rope_theta": rope.theta}
    if rope.scaling != "none":
        params["factor"] = rope.factor
    if rope.scaling in ("llama3", "yarn"):
        params["original_max_position_embeddings"] = rope.original_max_seq_len
    if rope.scaling == "llama3":
        params.update(low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor)
    if rope.scaling == "yarn":
        params.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow,
                      truncate=rope.yarn_truncate)
        if rope.attention_factor:
            params["attention_factor"] = rope.attention_factor
    return params

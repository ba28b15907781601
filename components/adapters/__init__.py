"""Adapters: small trainable modules added to a frozen model for fine-tuning (kind
``adapter``). A new type is one module here, listed in ``BUILTINS`` (the registry imports them
on first use)."""

BUILTINS: tuple[str, ...] = (
    "kiln.components.adapters.lora",
    "kiln.components.adapters.dora",
)

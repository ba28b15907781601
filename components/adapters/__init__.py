"""Adapters: small trainable modules added to a frozen model for fine-tuning (``lora``)."""

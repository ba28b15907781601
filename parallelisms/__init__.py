"""Parallelisms: float8, activation checkpointing, torch.compile and FSDP2, in that order."""

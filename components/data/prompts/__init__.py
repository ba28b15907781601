"""Prompt data: prompts with the fields rewards check (reinforcement learning)."""

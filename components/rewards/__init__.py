"""Rewards of reinforcement learning: registered components scoring completions."""

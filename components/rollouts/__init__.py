"""Rollouts: completions sampled from the policy for reinforcement learning."""

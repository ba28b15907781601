"""Hooks: periodic work around the step, one per module, each with its config."""

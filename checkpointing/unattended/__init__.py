"""Saves without a person watching: timed saves, preemption signals, failed saves."""

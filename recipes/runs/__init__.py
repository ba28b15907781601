"""Run folders: the lock, reading runs back, sweeps, the launcher, plots."""

"""Measurements: FLOPs and peak FLOP/s, process memory and start-up phases."""

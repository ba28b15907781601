"""Shipped TOML recipes (package data, so `kiln` finds them after a wheel install too)."""

from pathlib import Path

FOLDER = Path(__file__).resolve().parent

"""Normalisation layers (kind ``norm``)."""

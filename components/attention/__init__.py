"""Attention mixers (kind ``attention``)."""

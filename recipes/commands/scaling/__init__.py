"""The commands on ladders and scaling laws: ladder, fit, mup check (docs/scaling.md)."""

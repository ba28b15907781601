"""Recipes: loading, validation, diffing, the trainer and the `kiln` command line."""

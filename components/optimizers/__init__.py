"""Optimizers: each routes its own parameters (see routing.py) and follows its own schedule."""

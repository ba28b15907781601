"""The start-up health check: every rank and link answers before training."""

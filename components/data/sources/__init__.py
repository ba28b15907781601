"""Moved to ``kiln.components.sources``; these old paths warn and go in the next release."""

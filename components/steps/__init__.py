"""Step functions: how one optimizer step is computed from its micro-batches."""

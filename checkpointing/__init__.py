"""Checkpointing over torch.distributed.checkpoint, with the run's carry and guard payload."""

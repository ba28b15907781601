"""The training loop: the trainer and what only it uses: batch plan, metrics, inputs,
optimizers."""

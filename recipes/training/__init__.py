"""The training loop: the trainer and what only it uses: metrics, inputs, optimizers."""

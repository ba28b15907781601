"""Using a trained model: exports, generation, task scores, the harness model (reading the
model itself is ``recipes/loading``)."""

"""Using a trained model: saved models, pretrained imports, generation, task scores, the
harness model."""

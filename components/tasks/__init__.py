"""Downstream evaluation (kind ``task``): multiple choice by log-likelihood, generation with exact
match, bits per byte. A task reads its examples from local files (or the Hugging Face Hub cache),
plans deterministic batches, scores a batch with a ``Scorer`` (the model, passed in) and
summarises per-example values into metrics; ``runner`` splits the batches over data-parallel
ranks and reduces the values. See docs/evaluation.md."""

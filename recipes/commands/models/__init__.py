"""`kiln` subcommands on a trained or pretrained model: export, import, generate, eval and the
lm-evaluation-harness bridge."""

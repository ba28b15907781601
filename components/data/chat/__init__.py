"""Chat and instruction data for fine-tuning: conversations read from files, rendered with a
chat template, masked to the assistant's tokens and packed (the ``chat`` dataset)."""

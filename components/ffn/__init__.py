"""Feed-forward layers (kind ``ffn``)."""

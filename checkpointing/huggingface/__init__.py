"""Hugging Face files: config mapping, safetensors layout, import, export, Hub sync."""

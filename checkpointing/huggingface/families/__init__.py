"""The Hugging Face families whose layout is more than Llama's names: each module maps one family's
``config.json`` to a kiln ``[model]`` table and back, and its tensors to kiln's (``Part`` lists)."""

"""The chat tests' tokenizer folders (a byte-level BPE with each template), for the pairs."""

from tests.components.data.chat.conftest import hf_folders  # noqa: F401 (a fixture)

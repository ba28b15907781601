"""The chat tests' tokenizer folders (a byte-level BPE with each template), for the prompts."""

from tests.components.data.chat.conftest import hf_folders  # noqa: F401 (a fixture)

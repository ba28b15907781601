"""Fixtures the tokenizer tests share with the data tests."""

from tests.checkpointing.huggingface.test_hub import offline_cache  # noqa: F401 - the Hub cache fixture

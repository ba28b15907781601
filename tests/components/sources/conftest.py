"""Fixtures of the raw-text sources' tests."""

from tests.checkpointing.huggingface.test_hub import offline_cache  # noqa: F401 - the Hub cache fixture

"""Moved to ``kiln.components.tokenizers.chat_templates``;
this old path warns and goes in the next release."""

import warnings

from kiln.components.tokenizers.chat_templates import *  # noqa: F403 - the old module's public names

warnings.warn("kiln.components.data.chat.templates moved to "
              "kiln.components.tokenizers.chat_templates; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)

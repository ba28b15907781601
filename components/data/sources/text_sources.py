"""Moved to ``kiln.components.sources.text_sources``;
this old path warns and goes in the next release."""

import warnings

from kiln.components.sources.text_sources import *  # noqa: F403 - the old module's public names

warnings.warn("kiln.components.data.sources.text_sources moved to "
              "kiln.components.sources.text_sources; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)

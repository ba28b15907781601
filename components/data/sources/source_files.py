"""Moved to ``kiln.components.sources.source_files``;
this old path warns and goes in the next release."""

import warnings

from kiln.components.sources.source_files import *  # noqa: F403 - the old module's public names

warnings.warn("kiln.components.data.sources.source_files moved to "
              "kiln.components.sources.source_files; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)

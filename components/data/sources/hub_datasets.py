"""Moved to ``kiln.components.sources.hub_datasets``;
this old path warns and goes in the next release."""

import warnings

from kiln.components.sources.hub_datasets import *  # noqa: F403 - the old module's public names

warnings.warn("kiln.components.data.sources.hub_datasets moved to "
              "kiln.components.sources.hub_datasets; the old path goes in the next release",
              DeprecationWarning, stacklevel=2)

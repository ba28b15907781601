"""The ``[checkpoint]`` recipe table."""

from __future__ import annotations

from pydantic import Field

from components.base import Config


class CheckpointConfig(Config):
    """When and where the run saves, what it keeps, and how it resumes."""

    enable: bool = Field(True, description="save checkpoints at all")
    folder: str = Field("checkpoints", description="under the run folder, unless absolute")
    interval: int = Field(0, description="save every N steps (0 = only at the end)")
    keep_last: int = Field(3, description="immutable step_XXXXXXX snapshots to keep (0 = all)")
    async_save: bool = Field(
        False, alias="async", description="dcp.async_save: train while the save finishes"
    )
    resume: str = Field(
        "auto", description='"auto" (newest complete checkpoint in the run), "off", or a path'
    )
    weights_only: bool = Field(
        False, description="resume weights only: fresh optimizer, schedule and guard history"
    )
    from_ema: bool = Field(
        False, description="weights-only resume: use the optimizer's EMA weights when present"
    )
    skip_data_steps: int = Field(
        0, description="on resume, skip this many steps of data (avoid replaying a spike)"
    )

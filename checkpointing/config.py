"""The ``[checkpoint]`` recipe table."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from kiln.components.base import Config


class CheckpointConfig(Config):
    """When and where the run saves, what it keeps, and how it resumes."""

    enable: bool = Field(True, description="save checkpoints at all")
    folder: str = Field("checkpoints", description="under the run folder, unless absolute")
    interval: int = Field(0, ge=0, description="save every N steps (0 = only at the end)")
    interval_minutes: float = Field(
        0.0, ge=0, description="also save when this many minutes have passed since the last "
        "save, whatever the step rate (0 = off; rank 0's clock decides for all)"
    )
    keep_last: int = Field(
        3, ge=0, description="immutable step_XXXXXXX snapshots to keep (0 = all); `final` is kept"
    )
    async_save: bool = Field(
        False, alias="async", description="dcp.async_save: train while the save finishes"
    )
    on_save_error: Literal["stop", "continue"] = Field(
        "stop", description='a save that fails (a full disk, an I/O error): "stop" ends the run '
        'with an error naming the intact previous checkpoint (rerun to continue from it); '
        '"continue" prints the failure and trains on, the next interval save trying again (a '
        "failed final save, or the save before a preemption stop, always ends with the error); "
        "the partial save is removed either way"
    )
    resume: str = Field(
        "auto",
        description='"auto" (newest complete checkpoint of this run), "off", a checkpoint or '
        'run folder, or "hf://OWNER/REPO[/step_XXXXXXX]" to download one from the Hub',
    )
    init_from: str = Field(
        "", description='initial weights of a fresh run: a Hugging Face model folder, '
        '"hf://OWNER/NAME[@REVISION]" (config.json + safetensors; see `kiln import`), or a '
        "kiln checkpoint or run folder (its newest complete checkpoint; an adapters-only one "
        "arrives merged); a run that resumes its own checkpoint ignores it"
    )
    init_from_ignore: list[str] = Field(
        default_factory=list, description="config.json fields to accept although kiln does not "
        "know them (only for fields that do not change the computation)"
    )
    export_at_end: bool = Field(
        False, description="after the last step write <run folder>/export (Hugging Face layout "
        "when the model has one; every rank writes its share of the files)"
    )
    export_max_shard_size: str = Field(
        "5GB", description="largest safetensors file of an export; more files get an index"
    )
    strict_resume: bool = Field(
        False, description="when the snapshot resume picks is corrupt, stop with an error "
        "instead of moving it to checkpoints/corrupt/ and resuming from the newest valid one"
    )
    on_data_change: Literal["refuse", "continue"] = Field(
        "refuse", description="a resume whose data changed since the checkpoint (a source's "
        "files edited, truncated or deleted): refuse it naming the source, or continue from "
        "the saved cursor on the new data (one warning line)")
    weights_only: bool = Field(
        False, description="resume weights only: fresh optimizer, schedule and guard history"
    )
    from_ema: bool = Field(
        False, description="weights-only resume: use the optimizer's EMA weights when present"
    )
    keep_optimizer: bool = Field(
        False, description="weights-only resume: keep the optimizer's state (moments) too; the "
        "step count, LR schedule, data and guard history still start fresh (a new training "
        "stage from a finished run, docs/data.md)"
    )
    skip_data_steps: int = Field(
        0, ge=0,
        description="when resuming from an explicit path, skip this many steps of data (so a "
        "rollback does not replay the batches that caused a spike)",
    )
    preemption: bool = Field(
        True, description="on SIGTERM/SIGINT save at the next step boundary and exit 0"
    )
    hub_repo: str = Field(
        "", description='Hugging Face Hub repo "OWNER/NAME" to upload to ("" = no upload)'
    )
    hub_upload: Literal["checkpoints", "export", "both"] = Field(
        "checkpoints", description="what to upload: checkpoints, the final export, or both"
    )
    hub_keep: int = Field(2, ge=0, description="checkpoints kept on the Hub (0 = all)")
    hub_private: bool = Field(True, description="create the Hub repo as private")
    hub_token_env: str = Field(
        "HF_TOKEN", description="environment variable holding the Hub token (never logged)"
    )

    @model_validator(mode="after")
    def _keep_optimizer_needs_weights_only(self) -> CheckpointConfig:
        if self.keep_optimizer and not self.weights_only:
            raise ValueError("checkpoint.keep_optimizer = true needs checkpoint.weights_only = "
                             "true (a full resume keeps the optimizer state anyway)")
        return self

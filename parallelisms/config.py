"""The ``[parallelism]`` recipe table."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from components.base import Config


class ParallelismConfig(Config):
    """How the model is spread over devices and sped up; applied by `parallelisms.parallelize`."""

    dp_shard: int = Field(-1, description="FSDP2 shard degree; -1 = world size / dp_replicate")
    dp_replicate: int = Field(1, description="HSDP replicate degree (replicas of the sharded group)")
    fsdp: Literal["auto", "on", "off"] = Field(
        "auto", description="FSDP2 fully_shard: auto = on when the world size is > 1"
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="FSDP2 MixedPrecisionPolicy param dtype (compute dtype)"
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="FSDP2 MixedPrecisionPolicy gradient reduce dtype"
    )
    reshard_after_forward: Literal["default", "always", "never"] = Field(
        "default", description="FSDP2 resharding: default = all blocks but the last"
    )
    float8: Literal["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = Field(
        "off", description="torchao float8 training recipe for Linear layers"
    )
    float8_fallback: bool = Field(
        False, description="on hardware without fp8 support, train in high precision instead of failing"
    )
    float8_min_dim: int = Field(
        64, description="skip Linear layers whose in or out features are below this"
    )
    compile: bool = Field(False, description="torch.compile each block")
    compile_loss: bool = Field(False, description="also torch.compile the loss")
    compile_fullgraph: bool = Field(False, description="torch.compile(fullgraph=True)")
    activation_checkpoint: Literal["none", "full", "selective"] = Field(
        "none", description="recompute activations in backward: none | full | selective"
    )
    ac_every: int = Field(
        1, description="selective activation checkpointing: checkpoint every N-th block"
    )
    ac_ops: bool = Field(
        False, description="selective AC at op level (save matmuls, recompute the rest)"
    )
    meta_init: bool = Field(
        True, description="build on the meta device, shard, then initialise each shard"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="process-group backend: auto = nccl on CUDA, gloo on CPU"
    )

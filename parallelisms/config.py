"""The ``[parallelism]`` recipe table."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kiln.components.base import Config


class ParallelismConfig(Config):
    """How the model is spread over devices and sped up; applied by `kiln.parallelisms.parallelize`
    in a fixed order: pipeline split -> float8 -> expert parallel -> tensor parallel -> activation
    checkpointing -> per-block compile -> FSDP2 (context parallel shards the batch and gathers
    keys and values in attention, so it changes no module)."""

    # --------------------------------------------------------------------- data parallelism
    dp_shard: int = Field(
        -1, description="FSDP2 shard degree; -1 = world size / dp_replicate", ge=-1
    )
    dp_replicate: int = Field(
        1, ge=1, description="HSDP replicate degree (replicas of the sharded group)"
    )
    fsdp: Literal["auto", "on", "off"] = Field(
        "auto",
        description="FSDP2 fully_shard: auto = on when the world size is > 1; off = replicate "
        "the model and all-reduce gradients (DDP-style)",
    )
    param_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="FSDP2 MixedPrecisionPolicy param dtype (compute dtype)"
    )
    reduce_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="FSDP2 MixedPrecisionPolicy gradient reduce dtype"
    )
    reshard_after_forward: Literal["default", "always", "never"] = Field(
        "default",
        description="FSDP2 free gathered params after forward: default = every block but the "
        "last (its backward starts at once), always, never (ZeRO-2-like, more memory)",
    )
    grad_bucket_mb: int = Field(
        25, ge=1, description="fsdp = off: gradient all-reduce bucket size in MiB"
    )
    # -------------------------------------------------------------------- tensor parallelism
    tp: int = Field(
        1, ge=1,
        description="tensor-parallel degree: each block's heads and FFN hidden units split over "
        "tp neighbouring ranks (keep it within a node), norms and the residual stream "
        "sequence-parallel; the data-parallel degree is world size / tp",
    )
    loss_parallel: bool = Field(
        True,
        description="tp > 1: keep the LM head's logits sharded over the vocabulary and compute "
        "the cross-entropy on the shards (never gathers the full logits)",
    )
    # ------------------------------------------------------------------- context parallelism
    cp: int = Field(
        1, ge=1,
        description="context-parallel degree: every sequence split over cp ranks (each a head "
        "and a tail chunk, so causal work is even), keys and values all-gathered per layer; "
        "training.seq_len must divide into 2 x cp chunks; FSDP2 shards over dp_shard x cp",
    )
    # -------------------------------------------------------------------- expert parallelism
    ep: int = Field(
        1, ge=1,
        description="expert-parallel degree for ffn = moe: each MoE layer's experts split over "
        "ep data-parallel ranks (rows sent to them all-to-all), routers replicated; must divide "
        "world size / tp and model.ffn.n_experts",
    )
    # ------------------------------------------------------------------ pipeline parallelism
    pp: int = Field(
        1, ge=1,
        description="pipeline-parallel degree: the model's layers split into stages over pp "
        "groups of ranks (outermost mesh dimension), micro-batches flow through them "
        "(docs/pipeline.md); the data-parallel degree is world size / (pp x tp)",
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble",
                         "zbv_zero_bubble", "dualpipev"] = Field(
        "1f1b",
        description="pp > 1: torch.distributed.pipelining schedule; gpipe and 1f1b run one "
        "stage per rank, the others pp_stages_per_rank (interleaved_*: stage s on rank s mod "
        "pp; zbv_zero_bubble and dualpipev: 2 stages per rank in a V)",
    )
    pp_stages_per_rank: int = Field(
        2, ge=1,
        description="stages per rank of the interleaved schedules (zbv_zero_bubble and "
        "dualpipev always take 2; gpipe and 1f1b 1)",
    )
    pp_microbatches: int = Field(
        0, ge=0,
        description="pp > 1: micro-batches per pipeline run (schedule step); 0 = all of the "
        "step's micro-batches (training.grad_accum per data-parallel rank) in one run; N = "
        "grad_accum / N runs per optimizer step, N must divide grad_accum (fewer in flight: "
        "less activation memory, a larger bubble)",
    )
    pp_split: list[int] = Field(
        default_factory=list,
        description="layers per stage, in order (one entry per stage: pp x stages per rank; "
        "they sum to the model's layers); empty = balanced by training FLOPs per token "
        "(embeddings on the first stage, final norm, head and loss on the last)",
    )
    # ------------------------------------------------------------------------------ float8
    float8: Literal["off", "tensorwise", "rowwise", "rowwise_with_gw_hp"] = Field(
        "off", description="torchao float8 training recipe for Linear layers"
    )
    float8_fallback: bool = Field(
        False,
        description="on a GPU without fp8 (compute capability < 8.9) train in high precision "
        "instead of failing",
    )
    float8_emulate: Literal["auto", "on", "off"] = Field(
        "auto",
        description="run the fp8 matmuls as float32 products of the dequantized fp8 values "
        "(torchao's emulate; the casts and scales stay float8's): auto = on CPU, off on GPUs; off "
        "on CPU calls torch._scaled_mm's CPU kernel, about 100x slower than a float32 matmul",
    )
    float8_min_dim: int = Field(
        64, ge=1, description="skip Linear layers whose in or out features are below this"
    )
    float8_exclude: list[str] = Field(
        default_factory=list,
        description="more fnmatch patterns on module names to keep in high precision (the LM "
        "head `output`/`lm_head`, `*norm*` and `*embed*` are always kept)",
    )
    float8_fsdp_all_gather: bool = Field(
        True, description="tensorwise + FSDP2: all-gather weights in float8 (less traffic)"
    )
    float8_pad_inner_dim: Literal["auto", "on", "off"] = Field(
        "auto",
        description="pad fp8 matmuls' inner dimension to a multiple of 16 (torchao's "
        "pad_inner_dim): a GPU's torch._scaled_mm needs it, and the weight gradient's inner "
        "dimension is the micro-batch's token count; auto = on where that count can miss a "
        "multiple of 16 (a step whose rows vary in width, such as preference and grpo; "
        "micro_batch x seq_len / cp, or a context warmup's lengths, off the multiple), off "
        "otherwise (the padding copies the operands) and for rowwise_with_gw_hp",
    )
    # ----------------------------------------------------------------------------- compile
    compile: bool = Field(False, description="torch.compile each block")
    compile_loss: bool = Field(False, description="also torch.compile the loss")
    compile_fullgraph: bool = Field(
        False, description="torch.compile(fullgraph=True): fail on graph breaks"
    )
    compile_backend: Literal["inductor", "aot_eager", "eager"] = Field(
        "inductor",
        description="torch.compile backend: inductor (generated kernels) | aot_eager (forward "
        "and backward traced, run by eager ops: tells an inductor bug from a tracing one, and "
        "needs no C++ compiler) | eager (Dynamo's capture only)",
    )
    # ---------------------------------------------------------------- activation checkpoints
    activation_checkpoint: Literal["none", "full", "selective"] = Field(
        "none",
        description="recompute activations in backward: none | full (every block) | selective "
        "(every ac_every-th block, or op-level with ac_ops)",
    )
    ac_every: int = Field(
        2, ge=1, description="selective activation checkpointing: checkpoint every N-th block"
    )
    ac_ops: bool = Field(
        False,
        description="selective AC at op level on every block: save matmul and attention "
        "outputs, recompute the cheap element-wise ops",
    )
    # -------------------------------------------------------------------------------- init
    meta_init: bool = Field(
        True, description="build on the meta device, shard, then initialise each shard"
    )
    init_mode: Literal["auto", "replica", "sharded"] = Field(
        "auto",
        description="meta init: replica = initialise the full model then keep the local shard "
        "(bit-equal to single-process init; full model in memory for a moment); sharded = "
        "initialise the shards in place (never materialises the model, not bit-equal); auto = "
        "replica up to replica_init_max_params",
    )
    replica_init_max_params: int = Field(
        2_000_000_000, ge=0, description="init_mode = auto: largest model initialised as a replica"
    )
    backend: Literal["auto", "gloo", "nccl", "hccl", "xccl"] = Field(
        "auto", description="process-group backend: auto = the device type's (nccl on CUDA, "
        "hccl on Ascend NPUs, xccl on Intel XPUs, gloo on CPU)"
    )
    collective_timeout_s: float = Field(
        1800.0, gt=0, description="seconds a collective waits for its peers before it fails "
        "(torch.distributed's process-group timeout)"
    )
    flight_recorder: int = Field(
        2000, ge=0, description="collectives kept per process group by torch's flight recorder "
        "(TORCH_FR_BUFFER_SIZE, unless set in the environment) and written to RUN/hang/ by the "
        "hang watchdog (0 = off)"
    )

"""The dense decoder-only transformer (Llama 3 family), with torchtitan v0.2's module names
(``tok_embeddings``, ``layers``, ``norm``, ``output``; 0.3.0 calls the head ``lm_head``).

Model protocol the trainer and the parallelism code rely on: ``forward(ids) -> logits``,
``blocks()``, ``init_weights()``, ``flops_per_token(seq_len)`` and ``num_params()``; and the
pipeline stage contract (``pipeline_ends``, ``stage_forward``; docs/design.md): a copy pruned to
some blocks, with the embeddings or the norm and head set to None, runs and initialises as one
pipeline stage.

Initialisation (torchtitan llama3, so loss curves are comparable):
- untied ``tok_embeddings`` ~ N(0, 1); untied ``output`` ~ N(0, dim**-0.5) truncated at 3 sigma;
- tied (one matrix for both) ~ N(0, init_std), GPT-2 style, so the logits start small;
- block input projections ~ N(0, init_std); output projections (``wo``, ``w2``) ~ N(0, init_std /
  sqrt(2 * (layer_idx + 1))) with ``depth_init``, else N(0, init_std / sqrt(2 * n_layers)).
  torchtitan also gives ``w3`` the scaled std; kiln scales only the residual-stream writers.
- norms to 1, LayerScale to ``layerscale_init``, RoPE tables recomputed.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from kiln.components.attention.context import AttentionContext
from kiln.components.base import ComponentConfig, OptionalSub, Sub, component
from kiln.components.errors import RecipeError
from kiln.components.ffn.moe import idle_expert_params
from kiln.components.ffn.moe_model import MoEModelMixin
from kiln.components.models import mtp, mup
from kiln.components.models.absolute_positions import AbsolutePositions
from kiln.components.models.block import (
    RetiedOnEmpty,
    build_blocks,
    check_block_shapes,
    init_blocks,
    init_component,
    resolve_sizes,
)
from kiln.components.models.lm_head import HeadFn, head_operands, logits
from kiln.components.protocols import ModelContract
from kiln.components.registry import register


class TransformerConfig(ComponentConfig):
    dim: int = Field(256, ge=1, description="model (residual stream) width")
    n_layers: int = Field(6, ge=1, description="number of decoder blocks")
    vocab_size: int = Field(
        0, ge=0, description="0 = the tokenizer's vocabulary size rounded up to vocab_multiple")
    vocab_multiple: int = Field(
        64, ge=1, description="vocab_size = 0 pads the tokenizer's size to a multiple of this; "
        "the padded rows are never targets")
    max_seq_len: int = Field(0, ge=0, description="longest sequence (RoPE table); 0 = seq_len")
    tie_embeddings: bool = Field(False, description="share one matrix for input and output")
    dropout: float = Field(
        0.0, ge=0, lt=1, description="GPT-2's dropout while training: on the embeddings and on "
        "each block's attention and feed-forward outputs (0 = off; attention probabilities: "
        "attention.dropout)")
    absolute_positions: bool = Field(
        False, description="learned absolute position embeddings added to the token embeddings "
        "(GPT-2), model.max_seq_len rows; usually with attention.position.type = \"none\"")
    logit_softcap: float = Field(0.0, ge=0, description="logits = cap*tanh(logits/cap); 0 = off")
    init_std: float = Field(0.02, gt=0, description="std of the block weight init")
    depth_init: bool = Field(
        True, description="scale output-projection init by layer depth (else by n_layers)"
    )
    layerscale_init: float = Field(0.0, ge=0, description="LayerScale initial value; 0 = off")
    parametrization: Literal["standard", "mup"] = Field(
        "standard", description="mup: µP (Tensor Programs V): init, AdamW-family LRs, output "
        "multiplier and attention scale by width / base_dim, so hyperparameters tuned at "
        "base_dim transfer to other widths (docs/scaling.md)")
    base_dim: int = Field(256, ge=1, description="µP: the width where µP equals the standard "
                          "parametrization (where its hyperparameters were tuned)")
    base_head_dim: int = Field(
        0, ge=0, description="µP: attention scores scale as sqrt(base_head_dim) / head_dim; 0 = "
        "the head width (1/sqrt(head_dim): right when heads keep their width as dim grows)")
    mtp_depth: int = Field(
        0, ge=0, description="multi-token prediction modules (DeepSeek-V3: 1): module k "
        "predicts the token k + 1 ahead, trained beside the trunk, dropped in Hugging Face "
        "exports (docs/models.md)")
    mtp_weight: float = Field(0.3, ge=0, description="the modules' losses, averaged over "
                              "depths, times this join the trunk's (DeepSeek-V3: 0.3, then 0.1)")
    layer_types: list[Literal["full", "sliding", "linear"]] = Field(
        default_factory=list, description="one per layer: \"sliding\" attends within "
        "attention.window, \"full\" to every earlier token (Gemma's local / global pattern, "
        "gpt-oss's alternation), \"linear\" is a model.linear_attention layer (hybrids: "
        "Qwen3-Next's three Gated DeltaNet layers to one full); [] = every layer by attention")
    attention: Sub("attention") = component("attention", "causal", "token mixer of each block")
    linear_attention: OptionalSub("attention") = component(
        "attention", None, "the token mixer of the \"linear\" layers of model.layer_types",
        implied="gated_deltanet")
    ffn: Sub("ffn") = component("ffn", "swiglu", "feed-forward of each block")
    dense_layers: int = Field(
        0, ge=0, description="the first N layers take model.dense_ffn instead of model.ffn "
        "(DeepSeek-V3's first_k_dense_replace: 3 dense layers before the MoE ones)")
    dense_ffn: OptionalSub("ffn") = component(
        "ffn", None, "the feed-forward of the first model.dense_layers layers", implied="swiglu")
    norm: Sub("norm") = component("norm", "rmsnorm", "pre-norms and the final norm")

    @model_validator(mode="after")
    def _check(self) -> TransformerConfig:
        check_block_shapes(self)
        if (self.dense_layers > 0) != (self.dense_ffn is not None):
            raise ValueError("model.dense_ffn is the feed-forward of the first "
                             "model.dense_layers layers: give both or neither")
        if self.dense_layers > self.n_layers:
            raise ValueError(f"model.dense_layers = {self.dense_layers} is more than n_layers = "
                             f"{self.n_layers}")
        linear = self.linear_attention
        if ("linear" in self.layer_types) != (linear is not None):
            raise ValueError("model.linear_attention is the attention of the \"linear\" entries "
                             "of model.layer_types: give both or neither")
        if linear is not None and getattr(linear, "document_mask", False) and not getattr(
                self.attention, "document_mask", False):
            raise ValueError("model.linear_attention.document_mask = true: a hybrid's layers "
                             "follow model.attention.document_mask (one mask for every layer); "
                             "set that instead")
        if self.layer_types:
            window = getattr(self.attention, "window", None)
            if len(self.layer_types) != self.n_layers:
                raise ValueError(f"model.layer_types has {len(self.layer_types)} entries for "
                                 f"n_layers = {self.n_layers}: give one per layer")
            if window is None and "sliding" in self.layer_types:
                raise ValueError(f"model.layer_types: attention type {self.attention.type!r} "
                                 "has no window; use causal or differential attention")
            if "sliding" in self.layer_types and not window:
                raise ValueError("model.layer_types names sliding layers but "
                                 "model.attention.window = 0: set the window")
        if self.absolute_positions and not self.max_seq_len:
            raise ValueError("absolute_positions = true needs model.max_seq_len (the rows of the "
                             "learned position table, GPT-2's n_positions, e.g. 1024)")
        return self


@register("model", "transformer")
# MoEModelMixin: with MoE ffns, bias balancing, aux loss and metrics
class Transformer(MoEModelMixin, ModelContract, RetiedOnEmpty):
    """Dense decoder-only transformer (Llama 3 style: RMSNorm, RoPE, GQA, SwiGLU)."""

    Config = TransformerConfig
    # Pipeline stage contract: the modules besides ``layers`` on the first and the last stage.
    pipeline_ends = {"first": ("tok_embeddings",), "last": ("norm", "output")}

    def __init__(self, cfg: TransformerConfig, *, vocab_size: int, seq_len: int) -> None:
        super().__init__()
        self.vocab_size, self.max_seq_len = resolve_sizes("transformer", cfg, vocab_size, seq_len)
        if cfg.absolute_positions and seq_len > self.max_seq_len:
            raise RecipeError(
                f"a sequence of {seq_len} tokens (training.seq_len, or the length asked to "
                f"generate) is longer than model.max_seq_len = {self.max_seq_len}, the rows of "
                "the learned position table: raise model.max_seq_len or use shorter sequences")
        self.dim, self.n_layers = cfg.dim, cfg.n_layers
        self.tied = cfg.tie_embeddings
        self.logit_softcap = cfg.logit_softcap
        self.init_std, self.depth_init = cfg.init_std, cfg.depth_init
        self.width_mult = mup.width_mult(cfg)  # µP's m (1: the standard parametrization)
        dim, n = cfg.dim, cfg.n_layers
        # Constructors draw from the RNG (nn.Linear's default init); fork it so that
        # init_weights() below starts from the caller's RNG state, exactly as it does after
        # to_empty() on a meta-built model. (CPU generator; build on meta for other devices.)
        with torch.random.fork_rng(devices=[]):
            self.tok_embeddings = nn.Embedding(self.vocab_size, dim)
            self.pos_embeddings = (AbsolutePositions(self.max_seq_len, dim)
                                   if cfg.absolute_positions else None)
            self.layers = build_blocks(cfg, n, self.max_seq_len, dropout=cfg.dropout)
            self.embed_dropout = nn.Dropout(cfg.dropout) if cfg.dropout else None
            self.norm = cfg.norm.build(dim=dim)
            self.output = nn.Linear(dim, self.vocab_size, bias=False)
            self.mtp = mtp.build(cfg, n, self.max_seq_len)  # None without mtp_depth
        if self.tied:
            self.output.weight = self.tok_embeddings.weight
        self.mtp_weight = cfg.mtp_weight
        self._mtp_pending: torch.Tensor | None = None  # this forward's weighted MTP loss
        self._mtp_logged: list[list[torch.Tensor]] = []  # per depth, since the last metrics()
        if cfg.parametrization == "mup":
            mup.set_attention_scale([*self.blocks(), *(k.block for k in self.mtp or [])],
                                    cfg.base_head_dim)
        for block, kind in zip(self.blocks(), cfg.layer_types, strict=False):
            if kind == "full":  # [] leaves every layer at attention.window
                block.attention.window = 0
        if self.pos_embeddings is not None:  # a pipeline's first stage holds it too
            self.pipeline_ends = {**self.pipeline_ends,
                                  "first": ("tok_embeddings", "pos_embeddings")}
        if not self.tok_embeddings.weight.is_meta:
            self.init_weights()

    def blocks(self) -> list[nn.Module]:
        """The repeated decoder blocks (units of checkpointing, compile and FSDP sharding)."""
        return list(self.layers.values())

    @torch.no_grad()
    def init_weights(self) -> None:
        """Re-initialise every parameter and buffer from the current RNG, in a fixed order."""
        std = self.init_std
        if self.tok_embeddings is not None:  # None: a pipeline stage without it
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=std if self.tied else 1.0)
        if self.pos_embeddings is not None:
            nn.init.normal_(self.pos_embeddings.weight, mean=0.0, std=std)
        m = self.width_mult
        init_blocks(self.blocks(), std / m**0.5, self.depth_init,  # µP: variance 1 / fan_in
                    indices=[int(k) for k in self.layers], n_layers=self.n_layers)
        if m != 1.0:
            mup.rescale_routers(self.blocks(), m)
        if self.norm is not None:
            init_component(self.norm, std, std)
        if not self.tied and self.output is not None:
            out_std = self.dim**-0.5
            nn.init.trunc_normal_(self.output.weight, std=out_std, a=-3 * out_std, b=3 * out_std)
        if self.mtp is not None:  # last: the trunk draws what it draws without the modules
            mtp.init_weights(self.mtp, std / m**0.5, self.depth_init, self.n_layers)
            if m != 1.0:
                mup.rescale_routers([k.block for k in self.mtp], m)

    def forward(self, input_ids: torch.Tensor, *, head: HeadFn | None = None,
                context: AttentionContext | None = None,
                mtp_labels: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) -> logits (B, T, V); with ``head``, ``head(hidden, weight, softcap)`` instead
        (the trainer's chunked loss, ``lm_head``); ``context``: every block's attention layout
        (document mask, context parallel: ``attention/context.py``); ``mtp_labels`` (B, T):
        while training, the multi-token prediction modules' losses from these labels
        (``pop_aux_loss``, ``models/mtp.py``)."""
        if mtp_labels is None or self.mtp is None or not self.training:
            return self.stage_forward(input_ids, self.layers.keys(), first=True, last=True,
                                      head=head, context=context)
        hidden = self.stage_forward(input_ids, self.layers.keys(), first=True, last=False,
                                    context=context)
        depths = mtp.losses(self.mtp, self, hidden, input_ids, mtp_labels, context)
        self._mtp_pending = self.mtp_weight / len(depths) * torch.stack(depths).sum()
        self._mtp_logged.append([d.detach() for d in depths])
        return self.stage_forward(hidden, (), first=False, last=True, head=head)

    def stage_forward(self, x: torch.Tensor, keys, *, first: bool, last: bool,
                      head: HeadFn | None = None,
                      context: AttentionContext | None = None) -> torch.Tensor:
        """Blocks ``keys`` of ``layers``: from token ids (B, T) when ``first``, else from the
        previous stage's hidden states (B, T, dim); to logits / ``head(...)`` when ``last``,
        else to hidden states (B, T, dim)."""
        h = self.tok_embeddings(x) if first else x  # (B, T, dim)
        if first and self.pos_embeddings is not None:
            h = self.pos_embeddings(h, context)
        if first and self.embed_dropout is not None:
            h = self.embed_dropout(h)
        for key in keys:
            h = self.layers[key](h, context=context)
        if not last:
            return h
        h = self.norm(h)
        if self.width_mult != 1.0:  # µP's output multiplier 1 / m, on the logits' operand
            h = h * (1.0 / self.width_mult)
        if head is not None:
            return head(*head_operands(h, self.output), self.logit_softcap)
        return logits(h, self.output, self.logit_softcap)  # (B, T, V)

    def num_params(self, exclude_embeddings: bool = False, active_only: bool = False) -> int:
        """Distinct parameters (a tied matrix counts once); optionally minus the input table;
        ``active_only``: an MoE layer's routed experts count k of E (what one token uses)."""
        n = sum(p.numel() for p in self.parameters())
        if active_only:
            n -= idle_expert_params(self)
        if exclude_embeddings and self.tok_embeddings is not None:
            n -= self.tok_embeddings.weight.numel()
        if exclude_embeddings and self.pos_embeddings is not None:
            n -= self.pos_embeddings.weight.numel()
        return n

    def pop_aux_loss(self) -> torch.Tensor | None:
        """MoE balance losses and the multi-token prediction loss of the last forward."""
        parts = [p for p in (super().pop_aux_loss(), self._mtp_pending) if p is not None]
        self._mtp_pending = None
        return sum(parts[1:], parts[0]) if parts else None

    def metrics(self) -> dict[str, float]:
        """MoE loads, and each MTP depth's loss averaged since the last call."""
        out = super().metrics()
        if self._mtp_logged:
            means = torch.stack([torch.stack(d) for d in self._mtp_logged]).mean(0).tolist()
            out.update({f"mtp/loss_{k}": v for k, v in enumerate(means, start=1)})
            self._mtp_logged = []
        return out

    def width_multiplier(self) -> float:
        return self.width_mult

    def lr_multipliers(self) -> dict[str, float]:
        """µP: the hidden matrices' AdamW-family LR factor 1 / m (``models/mup.py``)."""
        m = self.width_mult
        return mup.hidden_multipliers(self, m) if m != 1.0 else {}

    def param_summary(self) -> dict[str, int]:
        """For ``kiln validate``: with MoE layers, the parameters one token uses."""
        if not self._moe_layers():
            return {}
        return {"active per token (MoE top-k)": self.num_params(active_only=True)}

    def flops_per_token(self, seq_len: int, mtp: bool = True) -> float:
        """Training FLOPs per token: 6 * N_matmul + 12 * sum_layers(H * Dh) * T; ``mtp``: with
        the multi-token prediction modules (a step that scores the main head runs the trunk).

        N_matmul is every parameter but the embedding lookup table (a tied matrix still counts,
        as the output matmul), counting only the active experts of MoE layers (k of E routed
        experts, the router and shared experts: the FLOPs a token really costs, as DeepSeek-V3
        and torchtitan count them); 6 = forward 2 + backward 4 per multiply-add. The attention term
        counts QK^T and AV over the full T x T square (no causal halving), like torchtitan and
        PaLM (Chowdhery et al. 2022, appendix B), so MFU numbers are comparable with theirs.
        An attention module may define ``attention_flops_per_token(seq_len)`` for its score and
        mixing matmuls (those without parameters); otherwise 12 * n_heads * head_dim * T is used.
        """
        n = self.num_params(exclude_embeddings=not self.tied, active_only=True)
        if self.tied and self.pos_embeddings is not None:  # a lookup table: no matmul
            n -= self.pos_embeddings.weight.numel()
        depths = list(self.mtp or []) if mtp else []
        blocks = [*self.blocks(), *(k.block for k in depths)]
        n += len(depths) * self.output.weight.numel()  # each depth runs the shared head again
        if self.mtp is not None and not mtp:  # the modules' own active parameters
            n -= sum(p.numel() for p in self.mtp.parameters()) - idle_expert_params(self.mtp)
        return float(6 * n + sum(_attention_flops(b.attention, seq_len) for b in blocks))


def _attention_flops(attention: nn.Module, seq_len: int) -> float:
    own = getattr(attention, "attention_flops_per_token", None)
    if own is not None:
        return float(own(seq_len))
    return float(12 * attention.n_heads * attention.head_dim * seq_len)

"""The pre-norm decoder block shared by model families, and the weight-init protocol it uses.

Init protocol for sub-components (so any registered attention / ffn / norm can be dropped in):
a module may define ``init_weights(std, out_std)`` (``out_std`` for projections that write
into the residual stream); otherwise every submodule's ``reset_parameters()`` and
``reset_buffers()`` are called.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def init_component(module: nn.Module, std: float, out_std: float) -> None:
    """Re-initialise ``module`` by the protocol above, in a fixed (registration) order."""
    init = getattr(module, "init_weights", None)
    if init is not None:
        init(std=std, out_std=out_std)
        return
    for sub in module.modules():
        for name in ("reset_parameters", "reset_buffers"):
            reset = getattr(sub, name, None)
            if reset is not None:
                reset()


class Block(nn.Module):
    """Pre-norm residual block with optional LayerScale (CaiT, Touvron et al. 2021).

    x = x + s1 * attention(attention_norm(x)); x = x + s2 * feed_forward(ffn_norm(x)).
    Names follow torchtitan's llama3 of v0.2.x (``attention``, ``feed_forward``,
    ``attention_norm``, ``ffn_norm``); see ``attention/causal.py`` for what 0.3.0 renamed.
    """

    def __init__(
        self, *, attention: nn.Module, feed_forward: nn.Module, attention_norm: nn.Module,
        ffn_norm: nn.Module, dim: int, layerscale_init: float = 0.0, dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.attention = attention
        self.feed_forward = feed_forward
        self.attention_norm = attention_norm
        self.ffn_norm = ffn_norm
        self.layerscale_init = layerscale_init
        if layerscale_init:
            self.attention_scale = nn.Parameter(torch.full((dim,), layerscale_init))
            self.ffn_scale = nn.Parameter(torch.full((dim,), layerscale_init))
        else:
            self.attention_scale = self.ffn_scale = None
        # GPT-2's residual dropout: on the attention's and the feed-forward's outputs
        self.dropout = nn.Dropout(dropout) if dropout else None

    def init_weights(self, std: float, out_std: float) -> None:
        init_component(self.attention_norm, std, out_std)
        init_component(self.attention, std, out_std)
        init_component(self.ffn_norm, std, out_std)
        init_component(self.feed_forward, std, out_std)
        if self.attention_scale is not None:
            nn.init.constant_(self.attention_scale, self.layerscale_init)
            nn.init.constant_(self.ffn_scale, self.layerscale_init)

    def forward(self, x: torch.Tensor, context: Any = None) -> torch.Tensor:  # (B, T, dim)
        """``context``: the forward's ``AttentionContext`` (document mask, context parallel),
        handed to the attention; None = plain causal (an attention without the keyword works)."""
        h = self.attention_norm(x)
        a = self.attention(h) if context is None else self.attention(h, context=context)
        if self.dropout is not None:
            a = self.dropout(a)
        x = x + a if self.attention_scale is None else x + self.attention_scale * a
        f = self.feed_forward(self.ffn_norm(x))
        if self.dropout is not None:
            f = self.dropout(f)
        return x + f if self.ffn_scale is None else x + self.ffn_scale * f


def build_blocks(cfg: Any, n_layers: int, max_seq_len: int, dropout: float = 0.0
                 ) -> nn.ModuleDict:
    """Blocks ``"0" .. str(n_layers - 1)`` from a model config's ``dim``, ``attention``, ``ffn``,
    ``norm`` and ``layerscale_init`` (the sub-components are built in that order per block);
    ``dropout``: the residual dropout of each block."""
    return nn.ModuleDict({
        str(i): build_block(cfg, attention_config(cfg, i), i, n_layers, max_seq_len, dropout)
        for i in range(n_layers)
    })


def build_block(cfg: Any, attention: Any, i: int, n_layers: int, max_seq_len: int,
                dropout: float = 0.0) -> Block:
    """One block at index ``i`` with the ``attention`` table and the config's ffn and norm."""
    dim = cfg.dim
    return Block(
        attention=attention.build(dim=dim, layer_idx=i, n_layers=n_layers,
                                  max_seq_len=max_seq_len),
        feed_forward=ffn_config(cfg, i).build(dim=dim, layer_idx=i, n_layers=n_layers),
        attention_norm=cfg.norm.build(dim=dim), ffn_norm=cfg.norm.build(dim=dim),
        dim=dim, layerscale_init=cfg.layerscale_init, dropout=dropout,
    )


def attention_config(cfg: Any, i: int) -> Any:
    """Layer ``i``'s attention table: ``linear_attention`` where ``layer_types`` says
    "linear" (a hybrid's linear-attention layers), else ``attention``."""
    kinds = getattr(cfg, "layer_types", None) or []
    if kinds and kinds[i] == "linear":
        return cfg.linear_attention
    return cfg.attention


def ffn_config(cfg: Any, i: int) -> Any:
    """Layer ``i``'s feed-forward table: ``dense_ffn`` for the first ``dense_layers`` layers
    (DeepSeek-V3's dense layers before the MoE ones), else ``ffn``."""
    if i < (getattr(cfg, "dense_layers", 0) or 0):
        return cfg.dense_ffn
    return cfg.ffn


def check_block_shapes(cfg: Any) -> None:
    """Raise ValueError when a model config's ``attention`` cannot be built at its ``dim`` (the
    attention config's optional ``shape_problem(dim)``). Model configs call it in a validator,
    so ``kiln validate`` / ``train`` report it as a recipe error naming the keys."""
    for table in (cfg.attention, getattr(cfg, "linear_attention", None)):
        check = getattr(table, "shape_problem", None)
        problem = check(cfg.dim) if check is not None else None
        if problem is not None:
            raise ValueError(problem)


def init_blocks(blocks: list[nn.Module], std: float, depth_init: bool, *,
                indices: list[int] | None = None, n_layers: int = 0) -> None:
    """Init each block with residual-writer std ``std / sqrt(2 * (i + 1))`` (``depth_init``)
    or ``std / sqrt(2 * n_layers)``; ``i`` is the block's index in the whole model (``indices``:
    a pipeline stage holds only some blocks), ``n_layers`` defaults to ``len(blocks)``."""
    indices = list(range(len(blocks))) if indices is None else indices
    total = n_layers or len(blocks)
    for i, block in zip(indices, blocks, strict=True):
        depth = 2 * (i + 1) if depth_init else 2 * total
        init_component(block, std, std / math.sqrt(depth))


def padded_vocab(cfg: Any, vocab_size: int) -> int:
    """The vocabulary a model config builds for a tokenizer of ``vocab_size`` ids: the config's
    ``vocab_size`` when set, else ``vocab_size`` rounded up to ``vocab_multiple`` (GEMM-friendly
    shapes; the extra rows are never targets, since data ids come from the tokenizer). Every
    caller that builds a model for a tokenizer passes ``vocab_size=padded_vocab(cfg, n)``."""
    multiple = getattr(cfg, "vocab_multiple", 1) or 1
    return getattr(cfg, "vocab_size", 0) or -(-vocab_size // multiple) * multiple


def resolve_sizes(family: str, cfg: Any, vocab_size: int, seq_len: int) -> tuple[int, int]:
    """(vocab size, max sequence length): the config's when set, else the values passed in."""
    vocab, max_len = cfg.vocab_size or vocab_size, cfg.max_seq_len or seq_len
    if vocab <= 0 or max_len <= 0:
        raise ValueError(
            f"{family} needs vocab_size and max_seq_len > 0 (got {vocab}, {max_len}); set "
            "model.vocab_size / model.max_seq_len or pass them in"
        )
    return vocab, max_len


class RetiedOnEmpty(nn.Module):
    """Mixin for models with ``tok_embeddings``/``output`` and a ``tied`` flag:
    ``nn.Module.to_empty`` from meta makes a new Parameter per module, which unties them."""

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True):
        super().to_empty(device=device, recurse=recurse)
        if (self.tied and self.output is not None and self.tok_embeddings is not None
                and self.output.weight is not self.tok_embeddings.weight):  # (pipeline stages)
            self.output.weight = self.tok_embeddings.weight
        return self
